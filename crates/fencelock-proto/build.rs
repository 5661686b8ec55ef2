//! Generates the gRPC code from `proto/` without a system `protoc`: `protox` (pure
//! Rust) parses the proto files into a `FileDescriptorSet`, and `tonic-prost-build`
//! generates the messages, the server and the client from that set.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/fencelock/v1/locks.proto";
    // The whole folder, so an imported file that changes is noticed too.
    println!("cargo:rerun-if-changed=proto");

    let files = protox::compile([PROTO], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Prost's own codec answers a malformed message with INTERNAL; ours says
        // INVALID_ARGUMENT (no client input may look like a server fault).
        .codec_path("crate::ProtoCodec")
        .compile_fds(files)?;
    Ok(())
}
