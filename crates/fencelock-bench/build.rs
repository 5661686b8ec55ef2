//! Compiles the etcd v3 protos without a system `protoc`: `protox` parses them,
//! `tonic-prost-build` generates clients only. `etcd/etcd.proto` (KV, Watch, Lease) is
//! the client crate's vendored copy (`crates/fencelock-etcd/proto/`), `etcd/v3lock.proto`
//! (the Lock service, which only the benchmark uses) is ours.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const CLIENT_PROTO: &str = "../fencelock-etcd/proto";
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed={CLIENT_PROTO}");
    let files = protox::compile(
        ["etcd/etcd.proto", "etcd/v3lock.proto"],
        ["proto", CLIENT_PROTO],
    )?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}
