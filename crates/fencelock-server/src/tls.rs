//! TLS for the one port (HTTP/1.1, HTTP/2 and gRPC): rustls with the `ring` crypto
//! provider only, certificate chain and private key from PEM files, ALPN `h2` and
//! `http/1.1`.
//!
//! The handshake runs in the connection's own task, under
//! [`crate::limits::Limits::tls_handshake_timeout`], so a slow or silent client never
//! holds up the accept loop (see `serve` in `lib.rs`).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Where the server's certificate and key are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_path: PathBuf,
}

/// The one crypto provider fencelock uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsConfig {
    /// Reads the files and builds the acceptor. Errors name the file and the problem.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert_path)
            .and_then(|certs| certs.collect())
            .map_err(|e| {
                format!(
                    "tls: cannot read certificates from {}: {e}",
                    self.cert_path.display()
                )
            })?;
        if certs.is_empty() {
            return Err(format!(
                "tls: no certificate in {}",
                self.cert_path.display()
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key_path).map_err(|e| {
            format!(
                "tls: cannot read a private key from {}: {e}",
                self.key_path.display()
            )
        })?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("tls: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                format!(
                    "tls: the key in {} does not fit the certificate in {}: {e}",
                    self.key_path.display(),
                    self.cert_path.display()
                )
            })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}
