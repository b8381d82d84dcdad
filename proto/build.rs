//! Generates the tonic/prost code for every .proto file under `proto/`, and
//! their encoded descriptor set for gRPC reflection.
//!
//! protoc is a system tool (Debian `protobuf-compiler`, with the well-known
//! `google/protobuf/*.proto` files from `libprotobuf-dev`), installed by
//! `make deps` (scripts/deps.sh); `PROTOC` may point at another binary.
//! It stays a system tool because etcd-client's build script runs protoc
//! too, and a crate cannot hand another crate's build script a protoc path:
//! a vendored or pure-Rust compiler here would leave that dependency in place.

use std::io;
use std::process::ExitCode;

/// The .proto files to compile, relative to this crate's root.
const PROTOS: &[&str] = &["proto/tandem/worker/v1/worker.proto", "proto/tandem/frontend/v1/frontend.proto"];

/// The encoded `FileDescriptorSet` of every file in `PROTOS`, in `OUT_DIR`,
/// served by gRPC reflection (`proto::FILE_DESCRIPTOR_SET`).
const DESCRIPTOR_SET: &str = "tandem_descriptor.bin";

/// Import root: package `a.b.v1` lives at `proto/a/b/v1/*.proto`.
const INCLUDE: &str = "proto";

fn main() -> ExitCode {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    println!("cargo:rerun-if-changed={INCLUDE}");
    println!("cargo:rerun-if-env-changed=PROTOC");

    let Some(out_dir) = std::env::var_os("OUT_DIR") else {
        eprintln!("error: OUT_DIR is not set (this build script runs under cargo)");
        return ExitCode::FAILURE;
    };
    let result = tonic_prost_build::configure()
        .file_descriptor_set_path(std::path::Path::new(&out_dir).join(DESCRIPTOR_SET))
        // rerun-if-changed lines are emitted above, once, for exactly our files.
        .emit_rerun_if_changed(false)
        .compile_protos(PROTOS, &[INCLUDE]);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            eprintln!(
                "error: protoc was not found: install protobuf-compiler and libprotobuf-dev \
                 (make deps), or set PROTOC to the protoc binary.\n({err})"
            );
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("error: compiling {PROTOS:?} failed: {err}");
            ExitCode::FAILURE
        }
    }
}
