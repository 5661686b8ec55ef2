//! Start-up and recovery errors are typed: a data directory in use is `Locked`
//! with its path, corrupt log data is `Corrupt` with the file and the offset, a
//! directory that cannot be created is `Io`, and a refused setting is `Config`.

use std::path::Path;

use fencelock_server::engine::recover;
use fencelock_server::{
    EngineConfig, RecoveryError, RecoveryErrorKind, Server, ServerConfig, StartError,
    StartErrorKind,
};

fn config(dir: &Path) -> ServerConfig {
    ServerConfig::new("127.0.0.1:0".parse().unwrap(), EngineConfig::new(dir))
}

async fn start_err(config: ServerConfig) -> StartError {
    match Server::start(config).await {
        Ok(server) => {
            server.shutdown().await.unwrap();
            panic!("the server started")
        }
        Err(e) => e,
    }
}

fn recovery_of(e: &StartError) -> &RecoveryError {
    assert_eq!(e.kind(), StartErrorKind::Recovery, "{e}");
    e.recovery().expect("a recovery error carries its details")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_in_use_is_locked_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let first = Server::start(config(dir.path())).await.unwrap();

    let e = start_err(config(dir.path())).await;
    let r = recovery_of(&e);
    assert_eq!(r.kind(), RecoveryErrorKind::Locked, "{e}");
    assert_eq!(r.path(), Some(dir.path()), "{e}");
    assert!(
        e.to_string().contains("in use by another fencelock server"),
        "{e}"
    );

    // The same from the offline entry point.
    let engine = EngineConfig::new(dir.path());
    let err = recover(Default::default(), dir.path(), &engine.core, None)
        .err()
        .expect("a directory in use is refused");
    assert_eq!(err.kind(), RecoveryErrorKind::Locked, "{err}");
    assert_eq!(err.path(), Some(dir.path()));

    first.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_log_is_corrupt_with_the_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path())).await.unwrap();
    server.shutdown().await.unwrap();
    // The first record (the start's own `Recover`) begins right after the 56-byte
    // segment header; flip a byte of its payload. A clean stop made it durable, so
    // this is damage, not a torn write.
    let seg = dir.path().join("log-0000000000000000.seg");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[56 + 8 + 2] ^= 0xff;
    std::fs::write(&seg, bytes).unwrap();

    let e = start_err(config(dir.path())).await;
    let r = recovery_of(&e);
    assert_eq!(r.kind(), RecoveryErrorKind::Corrupt, "{e}");
    assert_eq!(r.path(), Some(seg.as_path()), "{e}");
    assert_eq!(r.offset(), Some(56), "{e}");
    assert!(e.to_string().contains(&seg.display().to_string()), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_that_cannot_be_created_is_io() {
    // A path under a regular file cannot become a directory, even for root (which
    // reads any mode-000 directory).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let data = file.join("data");

    let e = start_err(config(&data)).await;
    let r = recovery_of(&e);
    assert_eq!(r.kind(), RecoveryErrorKind::Io, "{e}");
    assert_eq!(r.path(), Some(data.as_path()), "{e}");
    let source = std::error::Error::source(r).expect("the OS error is kept");
    assert!(!source.to_string().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_settings_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut exposed = config(dir.path());
    exposed.listen = "0.0.0.0:0".parse().unwrap();
    let e = start_err(exposed).await;
    assert_eq!(e.kind(), StartErrorKind::Config, "{e}");
    assert!(e.recovery().is_none());
    // Refused before the data directory was touched.
    assert!(!dir.path().join("log.manifest").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_in_use_is_a_listen_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.listen = taken.local_addr().unwrap();
    let e = start_err(config).await;
    assert_eq!(e.kind(), StartErrorKind::Listen, "{e}");
}
