//! How to reach etcd: endpoints, TLS, credentials, and where locks live.

use std::fmt;
use std::time::Duration;

use fencelock_backend::{Error, ErrorKind};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// Most cluster members one backend is configured with.
pub const MAX_ENDPOINTS: usize = 16;

/// How to reach an etcd cluster, and where in its key space locks live.
///
/// [`EtcdConfig::new`] gives the defaults for one plain-http member; set
/// [`tls`](EtcdConfig::tls) for `https://` endpoints and
/// [`credentials`](EtcdConfig::credentials) for a cluster with auth enabled.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// Client URLs of the cluster's members (`http://127.0.0.1:2379`, or `https://…`
    /// with [`tls`](EtcdConfig::tls)), 1 to [`MAX_ENDPOINTS`]; requests are spread
    /// over them. Left empty for [`EtcdBackend::from_channel`](crate::EtcdBackend::from_channel).
    pub endpoints: Vec<String>,
    /// TLS for `https://` endpoints: required for them, refused with `http://` ones
    /// (a plain endpoint next to a TLS setting is a mistake that would send everything,
    /// credentials included, in clear). Default none.
    pub tls: Option<EtcdTls>,
    /// A user and password for a cluster with auth enabled. Default none.
    pub credentials: Option<EtcdCredentials>,
    /// The key prefix of every lock: a grant is `<prefix>/<lock name>/<request id>`.
    /// Default `fencelock`. Clients that share locks must share the prefix; with auth,
    /// the user needs read and write permission on the keys starting with `<prefix>/`.
    pub prefix: String,
    /// How long to wait for a TCP connection (and TLS handshake). Default 5 s.
    pub connect_timeout: Duration,
    /// How long one request to etcd may take (waits on a lock are bounded by the
    /// request's own wait instead). Default 10 s.
    pub request_timeout: Duration,
}

impl EtcdConfig {
    /// The defaults for one member at `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints: vec![endpoint.into()],
            ..EtcdConfig::default()
        }
    }
}

/// No endpoints (what [`EtcdBackend::from_channel`](crate::EtcdBackend::from_channel)
/// wants), no TLS, no credentials, prefix `fencelock`, 5 s to connect, 10 s per request.
impl Default for EtcdConfig {
    fn default() -> EtcdConfig {
        EtcdConfig {
            endpoints: Vec::new(),
            tls: None,
            credentials: None,
            prefix: "fencelock".to_owned(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// TLS for `https://` endpoints (rustls): the CA certificates to trust and, for
/// servers that require client certificates (etcd's `--client-cert-auth`), the
/// client's own certificate. Every part is checked when it is given.
#[derive(Clone)]
pub struct EtcdTls {
    ca_pem: Vec<u8>,
    ca_count: usize,
    /// The client's certificate chain and private key, PEM.
    client: Option<(Vec<u8>, Vec<u8>)>,
    domain_name: Option<String>,
}

impl EtcdTls {
    /// Trusts the CA certificates in `ca_pem` (PEM, one or more) and no others.
    pub fn new(ca_pem: impl Into<Vec<u8>>) -> Result<EtcdTls, Error> {
        let ca_pem = ca_pem.into();
        let ca_count = certificates(&ca_pem, "the CA certificates")?;
        Ok(EtcdTls {
            ca_pem,
            ca_count,
            client: None,
            domain_name: None,
        })
    }

    /// Presents this client certificate (`cert_pem`, the chain, leaf first) and its
    /// private key (`key_pem`: PKCS#8, PKCS#1 or SEC1) when the server asks for one.
    pub fn with_client_certificate(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Result<EtcdTls, Error> {
        let (cert_pem, key_pem) = (cert_pem.into(), key_pem.into());
        certificates(&cert_pem, "the client certificate")?;
        // The parse error could quote key material: say only that it failed.
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| {
            invalid("the client key is not a PEM private key (PKCS#8, PKCS#1 or SEC1)")
        })?;
        self.client = Some((cert_pem, key_pem));
        Ok(self)
    }

    /// Checks the server's certificate against `name` instead of the endpoint's host
    /// (for endpoints given by IP address whose certificates name a host, say).
    pub fn with_domain_name(mut self, name: impl Into<String>) -> Result<EtcdTls, Error> {
        let name = name.into();
        ServerName::try_from(name.as_str())
            .map_err(|_| invalid(&format!("{name:?} is not a DNS name or IP address")))?;
        self.domain_name = Some(name);
        Ok(self)
    }

    /// Whether a client certificate is configured.
    pub(crate) fn has_client_certificate(&self) -> bool {
        self.client.is_some()
    }

    /// tonic's configuration for these settings.
    pub(crate) fn client_config(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.client {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(name) = &self.domain_name {
            config = config.domain_name(name.clone());
        }
        config
    }
}

/// Names what is configured, never the key.
impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_certificates", &self.ca_count)
            .field("client_certificate", &self.client.is_some())
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

/// A user name and password for etcd's auth (`etcdctl auth enable`).
#[derive(Clone)]
pub struct EtcdCredentials {
    user: String,
    password: String,
}

impl EtcdCredentials {
    /// Both must be non-empty; the password is never shown (`Debug` hides it) and
    /// never logged.
    pub fn new(
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Result<EtcdCredentials, Error> {
        let (user, password) = (user.into(), password.into());
        if user.is_empty() || user.chars().any(char::is_control) {
            return Err(invalid(
                "the etcd user name must be non-empty, without control characters",
            ));
        }
        if password.is_empty() {
            return Err(invalid("the etcd password must not be empty"));
        }
        Ok(EtcdCredentials { user, password })
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    pub(crate) fn password(&self) -> &str {
        &self.password
    }
}

/// Shows the user, hides the password.
impl fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<hidden>")
            .finish()
    }
}

/// How many certificates `pem` holds; an error unless at least one, all parseable.
fn certificates(pem: &[u8], what: &str) -> Result<usize, Error> {
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| invalid(&format!("{what}: not valid PEM ({e})")))?;
        count += 1;
    }
    if count == 0 {
        return Err(invalid(&format!(
            "{what}: no PEM certificate (-----BEGIN CERTIFICATE-----) found"
        )));
    }
    Ok(count)
}

fn invalid(message: &str) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_need_a_user_and_a_password_and_hide_the_password() {
        for (user, password) in [("", "secret"), ("app\n", "secret"), ("app", "")] {
            let e = EtcdCredentials::new(user, password).expect_err("accepted");
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{user:?}: {e}");
        }
        let credentials = EtcdCredentials::new("app", "hunter2-secret").expect("valid");
        assert_eq!(credentials.user(), "app");
        let mut config = EtcdConfig::new("http://127.0.0.1:2379");
        config.credentials = Some(credentials);
        let shown = format!("{config:?}");
        assert!(
            shown.contains("\"app\"") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
