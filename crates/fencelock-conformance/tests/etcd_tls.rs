//! The conformance suite against etcd over TLS, twice: with mutual TLS (the backend
//! presents a client certificate, `EtcdConfig::tls`), and through a TLS
//! `tonic` channel the application built itself (`EtcdBackend::from_channel`) with
//! auth on. Then what TLS must refuse: a client without a certificate where one is
//! required, a server whose certificate the client does not trust, malformed
//! settings.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fencelock::etcd::tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use fencelock::etcd::{EtcdBackend, EtcdConfig, EtcdCredentials, EtcdTls};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{step, Fixture};
use fencelock_testkit::{Etcd, EtcdOptions, EtcdUser, TestCa};

const LOCKER: (&str, &str) = ("locker", "locker-secret-password");

/// How the fixture's clients reach etcd.
enum Via {
    /// `EtcdConfig::tls` with these settings.
    Config(EtcdTls),
    /// A channel trusting this CA (PEM), with the lock user's credentials.
    Channel(Vec<u8>),
}

struct TlsFixture {
    // Field order matters: etcd stops before its certificates are removed.
    etcd: Etcd,
    via: Via,
    ca: TestCa,
    _dir: tempfile::TempDir,
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn client_tls(ca: &TestCa) -> EtcdTls {
    let (cert, key) = ca
        .peer("client", [127, 0, 0, 1].into())
        .expect("a client certificate");
    EtcdTls::new(read(&ca.ca_cert))
        .expect("the CA")
        .with_client_certificate(read(&cert), read(&key))
        .expect("the client certificate")
}

impl TlsFixture {
    fn backend(&self, url: String) -> Result<EtcdBackend, Error> {
        match &self.via {
            Via::Config(tls) => {
                let mut config = EtcdConfig::new(url);
                config.tls = Some(tls.clone());
                EtcdBackend::connect_lazy(config)
            }
            Via::Channel(ca_pem) => {
                // What an application with its own TLS setup does.
                let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
                let channel = Endpoint::from_shared(url)
                    .expect("endpoint")
                    .tls_config(tls)
                    .expect("TLS settings")
                    .connect_timeout(Duration::from_secs(5))
                    .connect_lazy();
                let mut config = EtcdConfig::default();
                config.credentials =
                    Some(EtcdCredentials::new(LOCKER.0, LOCKER.1).expect("credentials"));
                EtcdBackend::from_channel(channel, config)
            }
        }
    }
}

impl Fixture for TlsFixture {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.etcd.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend = self.backend(format!("https://{}", addrs[0]))?;
            // Connect now, as `EtcdBackend::connect` would.
            backend.queue("conformance:probe").await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

/// etcd serving TLS with a fresh CA; `mutual`: it requires client certificates,
/// else auth is on and clients come through an application's channel.
async fn start(mutual: bool) -> TlsFixture {
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ca = TestCa::create(dir.path()).expect("a test CA (Debian package openssl)");
        let mut options = EtcdOptions::default();
        options.tls = Some(ca.clone());
        let via = if mutual {
            options.client_cert_auth = true;
            Via::Config(client_tls(&ca))
        } else {
            options.users = vec![EtcdUser::new(LOCKER.0, LOCKER.1, "fencelock/")];
            Via::Channel(read(&ca.ca_cert))
        };
        let etcd = Etcd::start_with(&options).expect("etcd starts with TLS");
        TlsFixture {
            etcd,
            via,
            ca,
            _dir: dir,
        }
    })
    .await
    .expect("start task")
}

mod mutual_tls {
    fencelock_conformance::conformance_suite!(super::start(true));
}

mod application_channel_with_auth {
    fencelock_conformance::conformance_suite!(super::start(false));
}

fn try_once(name: &str) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, Duration::from_secs(60));
    spec.owner = "etcd-tls-test".to_owned();
    spec
}

/// The application's channel authenticated once, and the grant it made is a normal
/// one that the backend renews and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_channel_authenticates_once() {
    let fixture = start(false).await;
    let backend = fixture.backend(fixture.etcd.url()).expect("backend");
    assert_eq!(
        backend.authentications(),
        0,
        "authenticated before first use"
    );
    let lease = step(backend.acquire(&try_once("tls:channel")))
        .await
        .expect("acquire");
    step(backend.renew(&lease, lease.ttl)).await.expect("renew");
    assert!(step(backend.release(&lease)).await.expect("release"));
    assert_eq!(backend.authentications(), 1);
}

/// etcd requires a client certificate: a client without one cannot connect, and the
/// error says it is a connection failure that a client certificate may cure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused() {
    let fixture = start(true).await;
    let mut config = EtcdConfig::new(fixture.etcd.url());
    config.tls = Some(EtcdTls::new(read(&fixture.ca.ca_cert)).expect("the CA"));
    config.request_timeout = Duration::from_secs(5);
    let e = step(EtcdBackend::connect(config))
        .await
        .expect_err("connected without a client certificate");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("client certificate"), "{e}");
}

/// A server whose certificate another CA signed is refused, and the error names the
/// certificate as the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_outside_the_trusted_cas_is_refused() {
    let fixture = start(true).await;
    let other_dir = tempfile::tempdir().expect("a temporary directory");
    let other = TestCa::create(other_dir.path()).expect("another CA");
    let mut config = EtcdConfig::new(fixture.etcd.url());
    config.tls = Some(client_tls(&other));
    config.request_timeout = Duration::from_secs(5);
    let e = step(EtcdBackend::connect(config))
        .await
        .expect_err("trusted a server signed by another CA");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("certificate"), "{e}");
}

/// Malformed or inconsistent TLS settings are refused before anything is sent, and
/// no error or `Debug` output shows key material.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_settings_are_refused() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ca = TestCa::create(dir.path()).expect("a test CA");
    let ca_pem = read(&ca.ca_cert);
    let key_pem = read(&ca.server_key);
    let key_text = String::from_utf8_lossy(&key_pem).into_owned();
    let key_body = key_text.lines().nth(1).expect("a PEM body line");

    let invalid = |result: Result<EtcdTls, Error>| {
        let e = result.expect_err("bad TLS settings accepted");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(!e.to_string().contains(key_body), "{e} shows the key");
    };
    invalid(EtcdTls::new(b"not PEM".to_vec()));
    invalid(EtcdTls::new(key_pem.clone()));
    let tls = EtcdTls::new(ca_pem.clone()).expect("the CA");
    invalid(
        tls.clone()
            .with_client_certificate(b"no".to_vec(), key_pem.clone()),
    );
    invalid(
        tls.clone()
            .with_client_certificate(read(&ca.server_cert), ca_pem.clone()),
    );
    invalid(tls.clone().with_domain_name("not a name!"));
    let with_client = tls
        .clone()
        .with_client_certificate(read(&ca.server_cert), key_pem)
        .expect("a certificate and its key");
    let shown = format!("{with_client:?}");
    assert!(!shown.contains(key_body), "{shown}");

    let refused = |config: EtcdConfig| {
        let e = EtcdBackend::connect_lazy(config).expect_err("inconsistent settings");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    };
    refused(EtcdConfig::new("https://127.0.0.1:2379"));
    let mut plain_with_tls = EtcdConfig::new("http://127.0.0.1:2379");
    plain_with_tls.tls = Some(tls.clone());
    refused(plain_with_tls);
    let mut other_scheme = EtcdConfig::new("ftp://127.0.0.1:2379");
    other_scheme.tls = Some(tls.clone());
    refused(other_scheme);

    let channel = Endpoint::from_static("http://127.0.0.1:2379").connect_lazy();
    let e = EtcdBackend::from_channel(channel.clone(), EtcdConfig::new("http://127.0.0.1:2379"))
        .expect_err("endpoints next to a channel");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut tls_config = EtcdConfig::default();
    tls_config.tls = Some(tls);
    let e = EtcdBackend::from_channel(channel, tls_config).expect_err("TLS next to a channel");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}
