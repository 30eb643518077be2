//! Raw bindings (placeholder until the bindings land).
