//! Generates the gRPC code from `proto/` without a system `protoc`: `protox` (pure
//! Rust) parses the proto files into a `FileDescriptorSet`, and `tonic-prost-build`
//! generates the messages, the server and the client from that set. The set itself is
//! written next to the code (`fencelock_descriptor.bin`) for the server's gRPC
//! reflection.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/fencelock/v1/locks.proto";
    // The whole folder, so an imported file that changes is noticed too.
    println!("cargo:rerun-if-changed=proto");

    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler
        .include_source_info(true)
        .include_imports(true)
        .open_files([PROTO])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("fencelock_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Prost's own codec answers a malformed message with INTERNAL; ours says
        // INVALID_ARGUMENT (no client input may look like a server fault).
        .codec_path("crate::ProtoCodec")
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
