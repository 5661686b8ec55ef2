//! A throwaway certificate authority for TLS tests, made with the `openssl` command:
//! a server certificate, and cluster members' peer certificates for mutual TLS.

use std::path::{Path, PathBuf};

use crate::{Error, ErrorKind};

/// A test CA and a server certificate for `localhost` and `127.0.0.1` signed by it
/// (EC P-256, valid two days). PEM files in the directory given to
/// [`TestCa::create`].
#[derive(Debug, Clone)]
pub struct TestCa {
    /// The CA certificate: what clients trust.
    pub ca_cert: PathBuf,
    /// The server's certificate.
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<(), Error> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| {
            Error::new(
                ErrorKind::Missing,
                format!("cannot run openssl ({e}): install the Debian package openssl"),
            )
        })?;
    if !out.status.success() {
        return Err(Error::new(
            ErrorKind::Failed,
            format!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr)),
        ));
    }
    Ok(())
}

impl TestCa {
    /// Creates `ca.pem`, `server.pem` and `server.key` in `dir` with the `openssl`
    /// command (Debian package `openssl`).
    pub fn create(dir: &Path) -> Result<TestCa, Error> {
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=fencelock test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ]);
        openssl(dir, &ca)?;
        let mut csr = vec!["req"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        openssl(dir, &csr)?;
        std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    .map_err(|e| Error::io("write ext.cnf", e))?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "2",
                "-extfile",
                "ext.cnf",
            ],
        )?;
        Ok(TestCa {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
        })
    }

    /// Issues a cluster member's peer certificate, signed by this CA: usable as a
    /// server and as a client certificate (mutual TLS), for `ip`. Creates
    /// `<name>.pem` and `<name>.key` next to the CA's files and returns (certificate,
    /// key).
    pub fn peer(&self, name: &str, ip: std::net::IpAddr) -> Result<(PathBuf, PathBuf), Error> {
        let dir = self
            .ca_cert
            .parent()
            .ok_or_else(|| Error::new(ErrorKind::Failed, "the CA certificate has no directory"))?;
        let (key, csr, cert, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.cnf"),
        );
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={name}"),
            ],
        )?;
        std::fs::write(
            dir.join(&ext),
            format!(
                "subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
            ),
        )
        .map_err(|e| Error::io("write the extensions file", e))?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        )?;
        Ok((dir.join(cert), dir.join(key)))
    }
}
