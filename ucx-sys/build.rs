//! Binds `<ucp/api/ucp.h>` from the system UCX (Debian: `libucx-dev`, 1.13) and
//! links libucp/libucs. bindgen needs libclang (`libclang-dev`); both are
//! installed by `scripts/deps.sh`. A missing header or library is a build error
//! that names the package, not a silent fallback.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/wrapper.h");
    let header = "/usr/include/ucp/api/ucp.h";
    if !std::path::Path::new(header).is_file() {
        panic!("{header} not found: install libucx-dev (scripts/deps.sh does)");
    }
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");
    let bindings = bindgen::Builder::default()
        .header("src/wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .rustified_enum("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .expect("bindgen over <ucp/api/ucp.h> failed (libclang-dev installed?)");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("ucp.rs");
    bindings.write_to_file(out).expect("write ucp.rs");
}
