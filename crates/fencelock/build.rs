//! With the `etcd` feature: generates the etcd v3 gRPC client (KV, Watch, Lease) from
//! the vendored `proto/etcd/etcd.proto`, without a system `protoc` (`protox` parses,
//! `tonic-prost-build` generates). Without it, nothing to do.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    if std::env::var_os("CARGO_FEATURE_ETCD").is_some() {
        etcd()?;
    }
    Ok(())
}

#[cfg(feature = "etcd")]
fn etcd() -> Result<(), Box<dyn std::error::Error>> {
    let files = protox::compile(["etcd/etcd.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(files)?;
    Ok(())
}

#[cfg(not(feature = "etcd"))]
fn etcd() -> Result<(), Box<dyn std::error::Error>> {
    Err("the etcd feature is on but its build-dependencies are not".into())
}
