//! A throwaway certificate authority for TLS tests, made with the `openssl` command.

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
}
