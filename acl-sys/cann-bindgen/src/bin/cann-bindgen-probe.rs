//! `cann-bindgen-probe`: exits 0 when bindgen can generate bindings on this
//! host (libclang loads and parses a header including `<stddef.h>`), else
//! prints why and exits 1. `ci/deps.sh` runs it before deciding that libclang
//! needs no installing.
fn main() {
    match cann_bindgen::probe() {
        Ok(lib) => println!("cann-bindgen-probe: ok, libclang {}", lib.display()),
        Err(e) => {
            eprintln!("cann-bindgen-probe: {e}");
            std::process::exit(1);
        }
    }
}
