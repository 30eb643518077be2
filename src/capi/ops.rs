//! The MoE ops, their shape functions, and the runtime-aware reduce policy.
