//! The client against a server with authentication and TLS: tokens are sent, refusals
//! are `PermissionDenied`, `https://` URLs are verified against a given CA.

use std::time::Duration;

use fencelock::{Client, ErrorKind, ServerConfig};
use fencelock_server::{AuthConfig, EngineConfig, Role, Server, TlsConfig, TokenConfig};

const SECRET: &str = "client-secret-for-app";

async fn start(
    adjust: impl FnOnce(&mut fencelock_server::ServerConfig),
) -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = fencelock_server::ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        EngineConfig::new(dir.path().join("data")),
    );
    adjust(&mut config);
    (Server::start(config).await.unwrap(), dir)
}

fn connect_config(url: String, token: Option<&str>) -> ServerConfig {
    let mut config = ServerConfig::new(url);
    config.token = token.map(str::to_owned);
    config.connect_timeout = Duration::from_secs(5);
    config
}

#[tokio::test]
async fn tokens_are_sent_and_refusals_are_permission_denied() {
    let (server, _dir) = start(|c| {
        c.auth = AuthConfig {
            tokens: vec![TokenConfig {
                name: "app".into(),
                role: Role::Client,
                prefixes: vec!["app:".into()],
                sha256: fencelock_server::auth::hash_token(SECRET),
                acquire_rate: None,
                request_rate: None,
                quotas: Default::default(),
            }],
        };
    })
    .await;
    let url = format!("http://{}", server.local_addr());

    let client = Client::connect_with(connect_config(url.clone(), Some(SECRET)))
        .await
        .unwrap();
    let guard = client.lock("app:job").acquire().await.unwrap();
    assert!(guard.fence() > 0);
    let outside = client.lock("other:job").try_acquire().await.unwrap_err();
    assert_eq!(outside.kind(), ErrorKind::PermissionDenied, "{outside}");
    assert!(guard.release().await.unwrap());

    for token in [None, Some("wrong-secret")] {
        // A wrong token is refused when the connection says hello; no token, at the
        // first request.
        let err = match Client::connect_with(connect_config(url.clone(), token)).await {
            Err(e) => e,
            Ok(client) => client.lock("app:job").try_acquire().await.unwrap_err(),
        };
        assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{token:?}: {err}");
    }
    let err = Client::connect_with(connect_config(url, Some("bad\ntoken")))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn https_with_a_private_ca() {
    let certs = tempfile::tempdir().unwrap();
    let ca = fencelock_testkit::TestCa::create(certs.path()).unwrap();
    let (server, _dir) = start(|c| {
        c.tls = Some(TlsConfig {
            cert_path: ca.server_cert.clone(),
            key_path: ca.server_key.clone(),
        });
    })
    .await;
    let url = format!("https://localhost:{}", server.local_addr().port());

    let mut config = connect_config(url.clone(), None);
    config.ca_cert_pem = Some(std::fs::read(&ca.ca_cert).unwrap());
    let client = Client::connect_with(config.clone()).await.unwrap();
    let guard = client.lock("tls:job").acquire().await.unwrap();
    assert!(guard.release().await.unwrap());
    // That went over the wire protocol, inside TLS.
    let wire = |server: &Server| {
        server
            .handle()
            .metrics()
            .wire_connections
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert_eq!(wire(&server), 1);
    config.transport = fencelock::Transport::Grpc;
    let grpc = Client::connect_with(config).await.unwrap();
    let guard = grpc.lock("tls:job").acquire().await.unwrap();
    assert!(guard.release().await.unwrap());
    assert_eq!(wire(&server), 1, "gRPC when asked for");

    // The system's roots do not know the private CA: the handshake fails.
    let untrusted = Client::connect_with(connect_config(url, None))
        .await
        .unwrap_err();
    assert_eq!(untrusted.kind(), ErrorKind::Unavailable, "{untrusted}");

    // Plain HTTP to a TLS port does not get a lock either.
    let plain = format!("http://127.0.0.1:{}", server.local_addr().port());
    let refused = match Client::connect_with(connect_config(plain, None)).await {
        Err(e) => e,
        Ok(client) => client.lock("tls:job").try_acquire().await.unwrap_err(),
    };
    assert_eq!(refused.kind(), ErrorKind::Unavailable, "{refused}");

    // A CA for a plain URL is a mistake, said before anything is sent.
    let mut config = connect_config("http://127.0.0.1:1".into(), None);
    config.ca_cert_pem = Some(b"not used".to_vec());
    let err = Client::connect_with(config).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    server.shutdown().await.unwrap();
}
