//! Each server starts on its own port, serves, and is gone (process and directory)
//! after drop.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;

use fencelock_testkit::{probe, MariaDb, Postgres, Redis};

fn process_alive(pid: u32) -> bool {
    // A reaped child's /proc entry is gone.
    Path::new(&format!("/proc/{pid}")).exists()
}

fn port_open(port: u16) -> bool {
    TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok()
}

#[test]
fn redis_serves_then_stops_on_drop() {
    let redis = Redis::start().expect("redis starts");
    let port = redis.port();
    assert_ne!(port, 6379, "never the machine's own redis port");
    let reply = probe(port, b"SET k v\r\nGET k\r\n", 64).expect("redis answers");
    assert!(
        reply.starts_with(b"+OK"),
        "{:?}",
        String::from_utf8_lossy(&reply)
    );
    let dir = redis.dir().to_owned();
    assert!(dir.is_dir());
    drop(redis);
    assert!(!port_open(port), "port {port} still open after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}

#[test]
fn two_postgres_servers_are_independent_and_stop_on_drop() {
    let a = Postgres::start().expect("postgres starts");
    let b = Postgres::start().expect("a second postgres starts");
    assert_ne!(a.port(), b.port());
    assert_ne!(a.port(), 5432, "never the machine's own postgres port");
    assert!(a
        .connection_string()
        .contains(&format!("port={}", a.port())));
    assert_eq!(
        a.url(),
        format!("postgresql://postgres@127.0.0.1:{}/postgres", a.port())
    );
    let pid_file = a.dir().join("data/postmaster.pid");
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .expect("postmaster.pid")
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(process_alive(pid));
    let (port, dir) = (a.port(), a.dir().to_owned());
    drop(a);
    assert!(!process_alive(pid), "postmaster {pid} survived drop");
    assert!(!port_open(port), "port {port} still open after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
    assert!(
        port_open(b.port()),
        "dropping one server must not stop the other"
    );
}

#[test]
fn etcd_serves_then_stops_on_drop() {
    let etcd = fencelock_testkit::Etcd::start().expect("etcd starts");
    let port = etcd.port();
    assert_ne!(port, 2379, "never etcd's standard port");
    let reply = probe(
        port,
        b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        512,
    )
    .expect("etcd answers");
    assert!(
        String::from_utf8_lossy(&reply).contains("etcdserver"),
        "{:?}",
        String::from_utf8_lossy(&reply)
    );
    assert_eq!(etcd.url(), format!("http://127.0.0.1:{port}"));
    let (pid, dir) = (etcd.pid(), etcd.dir().to_owned());
    drop(etcd);
    assert!(!process_alive(pid), "etcd {pid} survived drop");
    assert!(!port_open(port), "port {port} still open after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}

#[test]
fn zookeeper_serves_then_stops_on_drop() {
    let zk = fencelock_testkit::ZooKeeper::start().expect("zookeeper starts");
    let port = zk.port();
    assert_ne!(port, 2181, "never ZooKeeper's standard port");
    assert_eq!(zk.connect_string(), format!("127.0.0.1:{port}"));
    let (pid, dir) = (zk.pid(), zk.dir().to_owned());
    assert!(dir.join("zoo.cfg").is_file());
    drop(zk);
    assert!(!process_alive(pid), "zookeeper {pid} survived drop");
    assert!(!port_open(port), "port {port} still open after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}

/// With TLS and users: clients get an `https://` URL, the plain listener is another
/// port, and auth is on (a request without a token is refused).
#[test]
fn etcd_with_tls_and_auth_starts_with_auth_on() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ca = fencelock_testkit::TestCa::create(dir.path()).expect("a test CA");
    let mut options = fencelock_testkit::EtcdOptions::default();
    options.users = vec![fencelock_testkit::EtcdUser::new(
        "app",
        "app-password",
        "app/",
    )];
    options.client_cert_auth = true;
    let e = fencelock_testkit::Etcd::start_with(&options).expect_err("client certs without TLS");
    assert_eq!(e.kind(), fencelock_testkit::ErrorKind::Failed, "{e}");
    options.tls = Some(ca);
    let etcd = fencelock_testkit::Etcd::start_with(&options).expect("etcd starts");
    let (port, admin) = (etcd.port(), etcd.admin_port());
    assert_ne!(port, admin);
    assert_eq!(etcd.url(), format!("https://127.0.0.1:{port}"));
    let body = r#"{"key":"YXBwL3g="}"#;
    let request = format!(
        "POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, admin)).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("read timeout");
    stream.write_all(request.as_bytes()).expect("send");
    // The whole answer: etcd closes the connection after it.
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("etcd answers");
    assert!(reply.contains("user name is empty"), "{reply:?}");
    let pid = etcd.pid();
    drop(etcd);
    assert!(!process_alive(pid), "etcd {pid} survived drop");
    assert!(!port_open(admin), "port {admin} still open after drop");
}

#[test]
fn mariadb_greets_survives_a_crash_and_stops_on_drop() {
    let mut server = MariaDb::start().expect("mariadb starts");
    let port = server.port();
    assert_ne!(port, 3306, "never the machine's own MariaDB port");
    // The handshake: protocol 10, then the server's version.
    let greeting = |port| probe(port, b"", 128).expect("mariadb greets");
    let hello = greeting(port);
    assert_eq!(hello[4], 10, "{:?}", String::from_utf8_lossy(&hello));
    assert!(String::from_utf8_lossy(&hello).contains("MariaDB"));
    server.crash_and_restart().expect("restarts");
    assert_eq!(server.port(), port, "a restart keeps the port");
    assert_eq!(greeting(port)[4], 10);
    let dir = server.dir().to_owned();
    drop(server);
    assert!(!port_open(port), "port {port} still open after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}
