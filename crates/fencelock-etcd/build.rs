//! Generates the etcd v3 gRPC client (KV, Watch, Lease, Auth) from the vendored
//! `proto/etcd/etcd.proto`, without a system `protoc` (`protox` parses,
//! `tonic-prost-build` generates).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(["etcd/etcd.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}
