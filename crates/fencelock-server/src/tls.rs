//! TLS for the one port (HTTP/1.1, HTTP/2 and gRPC): rustls with the `ring` crypto
//! provider only, certificate chain and private key from PEM files, ALPN `h2` and
//! `http/1.1`. And mutual TLS for the cluster's peer port ([`PeerTlsConfig`]).
//!
//! The handshake runs in the connection's own task, under
//! [`crate::limits::Limits::tls_handshake_timeout`], so a slow or silent client never
//! holds up the accept loop (see `serve` in `lib.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::startup::{ConfigError, ConfigErrorKind};

/// Where the server's certificate and key are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key_path: PathBuf,
}

/// Logs a warning if the leaf certificate is expired or not yet valid: clients will
/// refuse it, and the server would otherwise start as if all were well (issue 19,
/// item 8). Serving goes on: replacing the files and restarting is the operator's
/// call, and a wrong clock on this machine should not stop the server.
fn warn_if_not_valid_now(path: &std::path::Path, leaf: &CertificateDer<'_>) {
    let Some(validity) = Validity::of(leaf) else {
        tracing::warn!(
            path = %path.display(),
            "tls: cannot read the certificate's validity period; not checked"
        );
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    if now > validity.not_after {
        tracing::warn!(
            path = %path.display(),
            not_after = %validity.not_after_text,
            "tls: the certificate has EXPIRED (notAfter {}); clients will refuse it",
            validity.not_after_text
        );
    } else if now < validity.not_before {
        tracing::warn!(
            path = %path.display(),
            not_before = %validity.not_before_text,
            not_after = %validity.not_after_text,
            "tls: the certificate is NOT YET VALID (notBefore {}); clients will refuse it",
            validity.not_before_text
        );
    }
}

/// A certificate's validity period: Unix seconds, and as RFC 3339 text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Validity {
    not_before: i64,
    not_after: i64,
    not_before_text: String,
    not_after_text: String,
}

impl Validity {
    /// Reads `tbsCertificate.validity` with a minimal DER walk (RFC 5280 4.1): no
    /// crate in the dependency tree exposes it (webpki checks it but does not say
    /// what it found), and this needs five TLVs, not an X.509 parser.
    fn of(cert: &[u8]) -> Option<Validity> {
        let (_, certificate, _) = tlv(cert)?; // Certificate ::= SEQUENCE
        let (_, mut tbs, _) = tlv(certificate)?; // tbsCertificate ::= SEQUENCE
        let (tag, _, rest) = tlv(tbs)?;
        if tag == 0xa0 {
            tbs = rest; // [0] EXPLICIT version
        }
        for _ in 0..3 {
            tbs = tlv(tbs)?.2; // serialNumber, signature, issuer
        }
        let (0x30, validity, _) = tlv(tbs)? else {
            return None;
        };
        let (before_tag, before, rest) = tlv(validity)?;
        let (after_tag, after, _) = tlv(rest)?;
        let (not_before, not_before_text) = time(before_tag, before)?;
        let (not_after, not_after_text) = time(after_tag, after)?;
        Some(Validity {
            not_before,
            not_after,
            not_before_text,
            not_after_text,
        })
    }
}

/// One DER TLV at the start of `der`: tag, contents, and what follows.
fn tlv(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |len, b| (len << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// UTCTime (`YYMMDDHHMMSSZ`, tag 0x17) or GeneralizedTime (`YYYYMMDDHHMMSSZ`, tag
/// 0x18) as Unix seconds, and as RFC 3339 text.
fn time(tag: u8, text: &[u8]) -> Option<(i64, String)> {
    let digits = |s: &[u8]| -> Option<i64> {
        s.iter().try_fold(0i64, |n, c| {
            c.is_ascii_digit().then(|| n * 10 + i64::from(c - b'0'))
        })
    };
    let (year, rest) = match (tag, text.len()) {
        (0x17, 13) => {
            let yy = digits(&text[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (0x18, 15) => (digits(&text[..4])?, &text[4..]),
        _ => return None,
    };
    if rest[10] != b'Z' {
        return None;
    }
    let [month, day, hour, minute, second] =
        [0, 2, 4, 6, 8].map(|at| digits(&rest[at..at + 2]).unwrap_or(-1));
    let date = time::Date::from_calendar_date(
        i32::try_from(year).ok()?,
        time::Month::try_from(u8::try_from(month).ok()?).ok()?,
        u8::try_from(day).ok()?,
    )
    .ok()?;
    // A leap second (`60`) is the last second of its minute plus one.
    let leap = i64::from(second == 60);
    let clock = time::Time::from_hms(
        u8::try_from(hour).ok()?,
        u8::try_from(minute).ok()?,
        u8::try_from(second - leap).ok()?,
    )
    .ok()?;
    let seconds = date.with_time(clock).assume_utc().unix_timestamp() + leap;
    let text = format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z");
    Some((seconds, text))
}

/// The one crypto provider fencelock uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM certificate chain (at least one certificate).
/// A certificate or key that cannot be used.
fn tls_error(message: String) -> ConfigError {
    ConfigError::new(ConfigErrorKind::Tls, message)
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect())
        .map_err(|e| {
            tls_error(format!(
                "tls: cannot read certificates from {}: {e}",
                path.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(tls_error(format!(
            "tls: no certificate in {}",
            path.display()
        )));
    }
    Ok(certs)
}

/// Reads a PEM private key.
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        tls_error(format!(
            "tls: cannot read a private key from {}: {e}",
            path.display()
        ))
    })
}

impl TlsConfig {
    /// Reads the files and builds the acceptor. Errors name the file and the problem.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, ConfigError> {
        let certs = read_certs(&self.cert_path)?;
        warn_if_not_valid_now(&self.cert_path, &certs[0]);
        let key = read_key(&self.key_path)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(format!("tls: {e}")))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                tls_error(format!(
                    "tls: the key in {} does not fit the certificate in {}: {e}",
                    self.key_path.display(),
                    self.cert_path.display()
                ))
            })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// Mutual TLS on the cluster's peer port: this member's certificate and key, and the
/// CA that signed every member's certificate.
///
/// Every member both serves and dials, so one certificate does both: the peer
/// listener presents it and requires a client certificate signed by `ca_path`
/// (peer authentication), and a member dialing a peer presents it as its client
/// certificate and verifies the peer's against `ca_path`. So each certificate needs
/// `extendedKeyUsage = serverAuth, clientAuth` and a `subjectAltName` IP entry for
/// the IP of the member's peer address as the cluster records it (`--peers`,
/// `fencelock cluster add --peer-addr`), which is the name a peer is verified under
/// (also when `--peer-dial` dials it elsewhere).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTlsConfig {
    /// PEM file with this member's certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM file with its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_path: PathBuf,
    /// PEM file with the CA certificate(s) that sign every member's certificate.
    pub ca_path: PathBuf,
}

impl PeerTlsConfig {
    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, ConfigError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in read_certs(&self.ca_path)? {
            roots.add(cert).map_err(|e| {
                tls_error(format!(
                    "tls: {} holds a certificate that is not a usable CA: {e}",
                    self.ca_path.display()
                ))
            })?;
        }
        Ok(Arc::new(roots))
    }

    fn identity(
        &self,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ConfigError> {
        let certs = read_certs(&self.cert_path)?;
        warn_if_not_valid_now(&self.cert_path, &certs[0]);
        Ok((certs, read_key(&self.key_path)?))
    }

    fn mismatch(&self, e: rustls::Error) -> ConfigError {
        tls_error(format!(
            "tls: the key in {} does not fit the certificate in {}: {e}",
            self.key_path.display(),
            self.cert_path.display()
        ))
    }

    /// The peer listener's acceptor: presents this member's certificate, requires a
    /// client certificate signed by the CA, ALPN `h2`.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, ConfigError> {
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider())
                .build()
                .map_err(|e| tls_error(format!("tls: {}: {e}", self.ca_path.display())))?;
        let (certs, key) = self.identity()?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(format!("tls: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| self.mismatch(e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    /// What a member dials its peers with: trusts only the CA, presents this
    /// member's certificate, ALPN `h2`.
    pub fn connector(&self) -> Result<tokio_rustls::TlsConnector, ConfigError> {
        let (certs, key) = self.identity()?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(format!("tls: {e}")))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(certs, key)
            .map_err(|e| self.mismatch(e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER length: short form below 128, else long form.
    fn len(n: usize) -> Vec<u8> {
        if n < 0x80 {
            vec![n as u8]
        } else {
            vec![0x82, (n >> 8) as u8, n as u8]
        }
    }

    fn tlv_of(tag: u8, contents: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        out.extend(len(contents.len()));
        out.extend_from_slice(contents);
        out
    }

    /// The skeleton of a certificate: what the walk reads, with stand-ins for the
    /// rest (a real one from openssl is checked in `tests/security.rs`' TLS tests).
    fn cert(before: (u8, &str), after: (u8, &str), version: bool) -> Vec<u8> {
        let mut tbs = Vec::new();
        if version {
            tbs.extend(tlv_of(0xa0, &tlv_of(0x02, &[2])));
        }
        tbs.extend(tlv_of(0x02, &[0x01; 20])); // serial
        tbs.extend(tlv_of(0x30, &tlv_of(0x06, &[0x2a; 8]))); // signature algorithm
        tbs.extend(tlv_of(0x30, &[0x31; 200])); // issuer (long-form length)
        let mut validity = tlv_of(before.0, before.1.as_bytes());
        validity.extend(tlv_of(after.0, after.1.as_bytes()));
        tbs.extend(tlv_of(0x30, &validity));
        tbs.extend(tlv_of(0x30, &[0; 10])); // subject
        let mut certificate = tlv_of(0x30, &tbs);
        certificate.extend(tlv_of(0x30, &[0; 4])); // signature algorithm
        certificate.extend(tlv_of(0x03, &[0; 65])); // signature
        tlv_of(0x30, &certificate)
    }

    #[test]
    fn reads_not_before_and_not_after() {
        let c = cert((0x17, "240101000000Z"), (0x18, "20510630235959Z"), true);
        let v = Validity::of(&c).unwrap();
        assert_eq!(v.not_before, 1_704_067_200); // 2024-01-01T00:00:00Z
        assert_eq!(v.not_after, 2_571_782_399); // 2051-06-30T23:59:59Z
        assert_eq!(v.not_after_text, "2051-06-30T23:59:59Z");
        let old = cert((0x17, "991231235959Z"), (0x17, "000229120000Z"), false);
        let v = Validity::of(&old).unwrap();
        assert_eq!(v.not_before, 946_684_799); // 1999-12-31T23:59:59Z
        assert_eq!(v.not_after, 951_825_600); // 2000-02-29T12:00:00Z
    }

    #[test]
    fn malformed_certificates_are_none_not_a_panic() {
        let good = cert((0x17, "240101000000Z"), (0x17, "250101000000Z"), true);
        for cut in 0..good.len() {
            assert_eq!(Validity::of(&good[..cut]), None, "cut at {cut}");
        }
        let bad_time = cert((0x17, "24013100000Z"), (0x17, "251301000000Z"), true);
        assert_eq!(Validity::of(&bad_time), None);
        // A day its month does not have.
        let no_such_day = cert((0x17, "240101000000Z"), (0x17, "250230000000Z"), true);
        assert_eq!(Validity::of(&no_such_day), None);
        let leap_second = cert((0x18, "20161231235960Z"), (0x17, "250101000000Z"), true);
        assert_eq!(
            Validity::of(&leap_second).unwrap().not_before,
            1_483_228_800
        );
        assert_eq!(Validity::of(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
    }
}
