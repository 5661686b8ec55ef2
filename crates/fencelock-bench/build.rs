//! Compiles the vendored etcd v3 protos (`proto/etcd/`) without a system `protoc`:
//! `protox` parses them, `tonic-prost-build` generates clients only.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(["etcd/etcd.proto", "etcd/v3lock.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}
