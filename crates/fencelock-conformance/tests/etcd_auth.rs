//! The conformance suite against etcd with auth on (`fencelock::etcd` with
//! `EtcdConfig::credentials`): a throwaway etcd 3.4 per case whose lock user may read
//! and write `fencelock/` only. Then what auth adds: a wrong password or a user
//! without rights on the prefix is a clear `PermissionDenied`, a token etcd has
//! forgotten is replaced without the caller noticing, and credentials are harmless
//! where auth is off.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencelock::etcd::{EtcdBackend, EtcdConfig, EtcdCredentials};
use fencelock::{AcquireSpec, BoxFuture, Error, ErrorKind, LockBackend};
use fencelock_conformance::{step, Fixture};
use fencelock_testkit::{Etcd, EtcdOptions, EtcdUser};

/// May read and write the default prefix's keys.
const LOCKER: (&str, &str) = ("locker", "locker-secret-password");
/// May read and write `elsewhere/` only.
const STRANGER: (&str, &str) = ("stranger", "stranger-secret-password");

struct AuthFixture {
    etcd: Etcd,
}

fn config(url: String, (user, password): (&str, &str)) -> EtcdConfig {
    let mut config = EtcdConfig::new(url);
    config.credentials = Some(EtcdCredentials::new(user, password).expect("credentials"));
    config
}

impl AuthFixture {
    fn config(&self, user: (&str, &str)) -> EtcdConfig {
        config(self.etcd.url(), user)
    }

    async fn client(&self) -> EtcdBackend {
        step(EtcdBackend::connect(self.config(LOCKER)))
            .await
            .expect("connect to etcd as the lock user")
    }
}

impl Fixture for AuthFixture {
    fn addrs(&self) -> Vec<SocketAddr> {
        vec![SocketAddr::from(([127, 0, 0, 1], self.etcd.port()))]
    }

    fn connect<'a>(
        &'a self,
        addrs: &'a [SocketAddr],
    ) -> BoxFuture<'a, Result<Arc<dyn LockBackend>, Error>> {
        Box::pin(async move {
            let backend =
                EtcdBackend::connect(config(format!("http://{}", addrs[0]), LOCKER)).await?;
            Ok(Arc::new(backend) as Arc<dyn LockBackend>)
        })
    }
}

async fn start_with(auth_token_ttl_s: Option<u32>, users: bool) -> AuthFixture {
    let mut options = EtcdOptions::default();
    if users {
        options.users = vec![
            EtcdUser::new(LOCKER.0, LOCKER.1, "fencelock/"),
            EtcdUser::new(STRANGER.0, STRANGER.1, "elsewhere/"),
        ];
    }
    options.auth_token_ttl_s = auth_token_ttl_s;
    let etcd = tokio::task::spawn_blocking(move || Etcd::start_with(&options))
        .await
        .expect("start task")
        .expect("etcd starts with auth (Debian package etcd-server)");
    AuthFixture { etcd }
}

async fn start() -> AuthFixture {
    start_with(None, true).await
}

fencelock_conformance::conformance_suite!(start());

const LONG_TTL: Duration = Duration::from_secs(60);

fn try_once(name: &str) -> AcquireSpec {
    let mut spec = AcquireSpec::new(name, LONG_TTL);
    spec.owner = "etcd-auth-test".to_owned();
    spec
}

fn assert_denied(e: &Error, mentions: &str) {
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let text = e.to_string();
    assert!(
        text.contains(mentions),
        "{text:?} should mention {mentions:?}"
    );
    for (_, password) in [LOCKER, STRANGER] {
        assert!(!text.contains(password), "{text:?} shows a password");
    }
}

/// A wrong password or an unknown user is refused at connect, and at first use of a
/// lazy backend, as `PermissionDenied` naming the user (never the password); no
/// credentials at all on a cluster with auth is `PermissionDenied` that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_permission_denied() {
    let fixture = start().await;
    for user in [(LOCKER.0, STRANGER.1), ("nobody", LOCKER.1)] {
        let e = step(EtcdBackend::connect(fixture.config(user)))
            .await
            .expect_err("connected with a wrong password");
        assert_denied(&e, &format!("{:?}", user.0));
        assert!(e.to_string().contains("password"), "{e}");
        let lazy = EtcdBackend::connect_lazy(fixture.config(user)).expect("lazy");
        let e = step(lazy.acquire(&try_once("auth:wrong")))
            .await
            .expect_err("acquired with a wrong password");
        assert_denied(&e, &format!("{:?}", user.0));
    }
    let anonymous = EtcdBackend::connect_lazy(EtcdConfig::new(fixture.etcd.url())).expect("lazy");
    let e = step(anonymous.acquire(&try_once("auth:anonymous")))
        .await
        .expect_err("acquired without credentials");
    assert_denied(&e, "credentials");
    // The lock user, for contrast, gets the lock.
    let backend = fixture.client().await;
    let lease = step(backend.acquire(&try_once("auth:wrong")))
        .await
        .expect("acquire");
    assert!(step(backend.release(&lease)).await.expect("release"));
}

/// A user whose role grants nothing on the lock prefix is refused at connect and on
/// every operation; the same user with a prefix it may use locks normally, so the
/// refusal is about the prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_rights_on_the_prefix_is_denied() {
    let fixture = start().await;
    let e = step(EtcdBackend::connect(fixture.config(STRANGER)))
        .await
        .expect_err("connected without rights on the prefix");
    assert_denied(&e, "permission");
    let stranger = EtcdBackend::connect_lazy(fixture.config(STRANGER)).expect("lazy");
    let e = step(stranger.acquire(&try_once("auth:prefix")))
        .await
        .expect_err("acquired without rights on the prefix");
    assert_denied(&e, "permission");

    // A lock the lock user holds: the stranger can neither see, wait for, nor release it.
    let locker = fixture.client().await;
    let held = step(locker.acquire(&try_once("auth:prefix")))
        .await
        .expect("acquire");
    let e = step(stranger.queue("auth:prefix"))
        .await
        .expect_err("queue");
    assert_denied(&e, "permission");
    let e = step(stranger.release(&held))
        .await
        .expect_err("released another user's grant");
    assert_denied(&e, "permission");
    let e = step(stranger.renew(&held, LONG_TTL))
        .await
        .expect_err("renewed another user's grant");
    assert_denied(&e, "permission");
    assert_eq!(
        step(locker.queue("auth:prefix"))
            .await
            .expect("queue")
            .len(),
        1
    );
    assert!(step(locker.release(&held)).await.expect("release"));

    let mut own = fixture.config(STRANGER);
    own.prefix = "elsewhere".to_owned();
    let stranger = step(EtcdBackend::connect(own))
        .await
        .expect("connect with the user's own prefix");
    let lease = step(stranger.acquire(&try_once("auth:prefix")))
        .await
        .expect("acquire under the user's own prefix");
    assert!(step(stranger.release(&lease)).await.expect("release"));
}

/// Simple tokens expire after `--auth-token-ttl` (2 s here) unused. A backend left
/// idle past that authenticates again on its next request and the request succeeds:
/// a held grant is renewed and released, and a new grant is made, all with the
/// original backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_renewed() {
    let token_ttl = Duration::from_secs(2);
    let fixture = start_with(Some(2), true).await;
    let backend = fixture.client().await;
    assert_eq!(backend.authentications(), 1);
    let lease = step(backend.acquire(&try_once("auth:expiry")))
        .await
        .expect("acquire");
    // etcd checks for expired tokens once a second, so a token may outlive its ttl
    // by up to a second. Nothing shows that it expired short of using it (which
    // restarts its ttl), so: idle past the ttl, then use it; a few times at most.
    for _ in 0..5 {
        tokio::time::sleep(token_ttl * 2).await;
        step(backend.renew(&lease, LONG_TTL))
            .await
            .expect("renew after the token expired");
        if backend.authentications() > 1 {
            break;
        }
    }
    assert_eq!(
        backend.authentications(),
        2,
        "the token never expired, or it was replaced more than once"
    );
    assert!(step(backend.release(&lease)).await.expect("release"));

    // And a new grant, its first request refused for the token, the same way.
    for _ in 0..5 {
        tokio::time::sleep(token_ttl * 2).await;
        let again = step(backend.acquire(&try_once("auth:expiry")))
            .await
            .expect("acquire after the token expired");
        assert!(again.fence > lease.fence);
        assert!(step(backend.release(&again)).await.expect("release"));
        if backend.authentications() > 2 {
            break;
        }
    }
    assert_eq!(backend.authentications(), 3);
}

/// Credentials for a cluster without auth are accepted and unused, as with etcd's own
/// client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_unused_where_auth_is_off() {
    let fixture = start_with(None, false).await;
    let backend = fixture.client().await;
    assert_eq!(backend.authentications(), 1);
    let lease = step(backend.acquire(&try_once("auth:off")))
        .await
        .expect("acquire");
    assert!(step(backend.release(&lease)).await.expect("release"));
    assert_eq!(backend.authentications(), 1);
}

/// Neither the configuration nor the backend shows the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_is_never_shown() {
    let fixture = start().await;
    let config = fixture.config(LOCKER);
    let shown = format!("{config:?}");
    assert!(
        shown.contains(LOCKER.0) && !shown.contains(LOCKER.1),
        "{shown}"
    );
    let backend = fixture.client().await;
    let shown = format!("{backend:?}");
    assert!(!shown.contains(LOCKER.1), "{shown}");
}
