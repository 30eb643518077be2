//! Generates the HCCL bindings when CANN headers and libclang are present;
//! otherwise the committed `src/bindings.rs` is used. See `cann-bindgen`.
fn main() {
    cann_bindgen::build(cann_bindgen::Crate::Hccl);
}
