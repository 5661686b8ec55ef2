//! Authentication (bearer tokens) and authorization (roles and lock-name prefixes),
//! for HTTP/JSON, gRPC and the dashboard alike.
//!
//! **Tokens.** The config holds, per token, a name, a [`Role`], the lock-name
//! prefixes it may touch, and the SHA-256 of the token (never the token itself; see
//! [`hash_token`], and `fencelock token new`). Tokens are 256-bit random strings
//! ([`new_token`]), so an unsalted hash is as good as a password hash here, and
//! cheap enough to compute on every request. A presented token is hashed and
//! compared with *every* configured hash in constant time ([`Authenticator`]).
//!
//! **Where the token comes from.** `Authorization: Bearer <token>` (HTTP and gRPC
//! metadata alike), or, for browsers, the cookie [`TOKEN_COOKIE`]. A request
//! authenticated by the cookie that changes state (any method but GET/HEAD/OPTIONS)
//! must come from the server's own origin (`Origin` or `Sec-Fetch-Site`), so another
//! site cannot make a visitor's browser act for them (CSRF).
//!
//! **The layer.** [`layer`] runs before every route. It puts the caller's
//! [`Principal`] into the request extensions, or refuses the request: 401
//! `unauthenticated` (gRPC UNAUTHENTICATED). `/healthz`, `/readyz` and the API's
//! descriptions (`/v1/openapi.json`, gRPC reflection) are open: the descriptions
//! show only the API's shape, the same for everyone, never any state.
//! Dashboard pages (`/` and `/ui/…`) are let through without a principal when the
//! credentials are missing or wrong, so the dashboard can show its login form; the
//! dashboard must then call [`authorize`] itself, which fails closed.
//!
//! **Handlers** decide what the caller may do once the request is parsed (the lock
//! name is in the body): [`Principal::authorize`] answers 403 `permission_denied`
//! (gRPC PERMISSION_DENIED) for a role that does not allow the [`Action`] or a lock
//! name outside the token's prefixes. Listings and watches are cut down to the
//! token's prefixes ([`Principal::ranges`]).
//!
//! **No tokens configured** means authentication is off: every request gets
//! [`Principal::anonymous`] (admin on every lock), and the server refuses to listen
//! on anything but loopback unless told `insecure` ([`check_exposure`]).

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use fencelock_core::RequestId;

use crate::error::{ApiError, ApiErrorKind};
use crate::limits::{Limits, QuotaOverrides, Quotas, RateLimit, TokenBucket};
use crate::startup::{ConfigError, ConfigErrorKind};

/// A refused auth setting.
fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::invalid(message)
}

/// Name of the cookie that carries a token for browsers (the dashboard's login form
/// sets it). Set it `HttpOnly; SameSite=Strict` (and `Secure` over TLS).
pub const TOKEN_COOKIE: &str = "fencelock_token";
/// Longest token name, in bytes.
pub const MAX_TOKEN_NAME_BYTES: usize = 64;
/// Longest token accepted from a client, in bytes (longer ones are unknown anyway).
pub const MAX_TOKEN_BYTES: usize = 512;
/// The prefix of tokens made by [`new_token`].
pub const TOKEN_PREFIX: &str = "flk_";

/// What a token may do. Each role includes the one before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Read-only: show and list locks, watch events, metrics, the audit log.
    Reader,
    /// A lock user: everything a reader may, plus acquire, renew, release, sessions.
    Client,
    /// An operator: everything, including force-release and snapshots (backups).
    Admin,
}

impl Role {
    /// The role's name in the config (`reader`, `client`, `admin`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Client => "client",
            Role::Admin => "admin",
        }
    }

    /// Whether the role allows `action` (prefixes aside).
    pub fn permits(self, action: Action) -> bool {
        let needed = match action {
            Action::Read | Action::Watch | Action::Metrics | Action::Audit => Role::Reader,
            Action::Acquire | Action::Renew | Action::Release | Action::Session => Role::Client,
            Action::ForceRelease | Action::Snapshot => Role::Admin,
        };
        self >= needed
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Role, ConfigError> {
        match s {
            "reader" => Ok(Role::Reader),
            "client" => Ok(Role::Client),
            "admin" => Ok(Role::Admin),
            other => Err(ConfigError::invalid(format!(
                "unknown role {other:?}; expected reader, client or admin"
            ))),
        }
    }
}

/// Something a caller wants to do, checked by [`Principal::authorize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Action {
    /// Show a lock or list locks (reader).
    Read,
    /// Stream lock events (reader).
    Watch,
    /// Read `/metrics` (reader whose prefixes include `""`: the metrics count every
    /// lock).
    Metrics,
    /// Read the audit log (reader; entries are filtered by prefix).
    Audit,
    /// Acquire a lock (client).
    Acquire,
    /// Renew a grant (client).
    Renew,
    /// Release a grant (client).
    Release,
    /// Open, keep alive or close a session (client). Session ids are unguessable
    /// capabilities, like owner tokens; they are not tied to a token.
    Session,
    /// Force-release a lock (admin).
    ForceRelease,
    /// Take a snapshot, i.e. a backup of every lock (admin whose prefixes include
    /// the empty prefix, i.e. every lock).
    Snapshot,
}

impl Action {
    fn describe(self) -> &'static str {
        match self {
            Action::Read => "read locks",
            Action::Watch => "watch lock events",
            Action::Metrics => "read metrics",
            Action::Audit => "read the audit log",
            Action::Acquire => "acquire locks",
            Action::Renew => "renew grants",
            Action::Release => "release grants",
            Action::Session => "manage sessions",
            Action::ForceRelease => "force-release locks",
            Action::Snapshot => "take snapshots",
        }
    }
}

/// One token of the config, as the server needs it (see [`AuthConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenConfig {
    /// Who this token is: names the caller in logs, the audit log, and scopes its
    /// `request_id`s. `[A-Za-z0-9_.-]`, 1..=64 bytes, unique.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// The lock-name prefixes it may touch; `""` means every lock. At least one.
    pub prefixes: Vec<String>,
    /// SHA-256 of the token, 64 lower- or upper-case hex digits ([`hash_token`]).
    pub sha256: String,
    /// Acquire attempts per second for this token, overriding
    /// [`crate::limits::Limits::acquire_rate`]; `None` takes that default.
    pub acquire_rate: Option<RateLimit>,
    /// Other mutating requests per second for this token, overriding
    /// [`crate::limits::Limits::request_rate`]; `None` takes that default.
    pub request_rate: Option<RateLimit>,
    /// This token's own quotas; a field left `None` takes the default of
    /// [`crate::limits::Limits::quotas`].
    pub quotas: QuotaOverrides,
}

/// The tokens the server accepts. Empty: authentication is off (loopback only,
/// unless `insecure`; see [`check_exposure`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthConfig {
    /// The accepted tokens.
    pub tokens: Vec<TokenConfig>,
}

impl AuthConfig {
    /// Whether any token is configured (authentication on).
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }
}

/// SHA-256 of `token`, as 64 lower-case hex digits: what the config stores.
pub fn hash_token(token: &str) -> String {
    hex::encode(sha256(token.as_bytes()))
}

/// A fresh random token (256 bits from the OS, hex, with the prefix
/// [`TOKEN_PREFIX`] so it is recognisable in a leaked file).
pub fn new_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(format!("{TOKEN_PREFIX}{}", hex::encode(bytes)))
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// 64 hex digits (either case) as a SHA-256 digest.
fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// Equality of two digests in time independent of where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    use subtle::ConstantTimeEq;
    a[..].ct_eq(&b[..]).into()
}

/// Equality of two secrets in time independent of their content: both are hashed
/// first, so neither where they differ nor their lengths show in the timing.
pub(crate) fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    let digest = |x: &[u8]| {
        let mut out = [0u8; 32];
        out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, x).as_ref());
        out
    };
    constant_time_eq(&digest(a), &digest(b))
}

/// Whether `name` is acceptable as a token name.
fn valid_token_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOKEN_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

/// Refuses a configuration that would expose an unauthenticated server: with no
/// tokens, only loopback addresses may be served unless `insecure` is set.
pub fn check_exposure(
    listen: SocketAddr,
    auth: &AuthConfig,
    insecure: bool,
) -> Result<(), ConfigError> {
    if auth.enabled() || insecure || listen.ip().is_loopback() {
        return Ok(());
    }
    Err(ConfigError::new(
        ConfigErrorKind::Insecure,
        format!(
            "refusing to serve {listen} without authentication: configure tokens under [auth] \
             (see `fencelock token new`), listen on a loopback address such as 127.0.0.1, \
             or pass --insecure to serve everyone who can reach this address"
        ),
    ))
}

struct Identity {
    name: Box<str>,
    role: Role,
    prefixes: Box<[Box<str>]>,
    /// `None` for the anonymous principal (authentication off).
    hash: Option<[u8; 32]>,
    bucket: Option<Mutex<TokenBucket>>,
    /// Other mutating requests (see [`Limits::request_rate`]).
    request_bucket: Option<Mutex<TokenBucket>>,
    /// `None` for the anonymous principal (authentication off).
    quotas: Option<Quotas>,
    /// Event streams open now (see [`Principal::open_stream`]).
    streams: AtomicU32,
    /// The name as the core keys ownership and quotas by it, made once so a request
    /// costs no allocation for it.
    tenant: Option<fencelock_core::Tenant>,
}

/// Who is calling: a configured token (name, role, prefixes), or the anonymous
/// principal when authentication is off. Found in every request's extensions once
/// the [`layer`] ran (dashboard pages: only with valid credentials).
#[derive(Clone)]
pub struct Principal {
    identity: Arc<Identity>,
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Principal")
            .field("name", &self.name())
            .field("role", &self.role())
            .field("prefixes", &self.prefixes().collect::<Vec<_>>())
            .finish()
    }
}

impl Principal {
    /// The caller when authentication is off: named `anonymous`, admin on every lock,
    /// never rate limited.
    pub fn anonymous() -> Principal {
        // One shared identity: every request with authentication off is this caller.
        static ANONYMOUS: std::sync::OnceLock<Principal> = std::sync::OnceLock::new();
        ANONYMOUS
            .get_or_init(|| Principal {
                identity: Arc::new(Identity {
                    name: "anonymous".into(),
                    role: Role::Admin,
                    prefixes: Box::new(["".into()]),
                    hash: None,
                    bucket: None,
                    request_bucket: None,
                    quotas: None,
                    streams: AtomicU32::new(0),
                    tenant: fencelock_core::Tenant::new("anonymous").ok(),
                }),
            })
            .clone()
    }

    /// The name as the core keys sessions, grants and quotas by it (`None` only if
    /// the name is not a valid [`fencelock_core::Tenant`], which config checks rule out).
    pub fn tenant(&self) -> Option<fencelock_core::Tenant> {
        self.identity.tenant.clone()
    }

    /// The token's name (`anonymous` when authentication is off).
    pub fn name(&self) -> &str {
        &self.identity.name
    }

    /// The token's role.
    pub fn role(&self) -> Role {
        self.identity.role
    }

    /// The lock-name prefixes the token may touch (`""`: every lock).
    pub fn prefixes(&self) -> impl Iterator<Item = &str> {
        self.identity.prefixes.iter().map(|p| &**p)
    }

    /// Whether this is the anonymous principal (authentication off).
    pub fn is_anonymous(&self) -> bool {
        self.identity.hash.is_none()
    }

    /// Whether `name` lies within one of the token's prefixes.
    pub fn covers(&self, name: &str) -> bool {
        self.prefixes().any(|p| name.starts_with(p))
    }

    /// Whether the token covers every lock (has the empty prefix).
    pub fn covers_everything(&self) -> bool {
        self.prefixes().any(str::is_empty)
    }

    /// Checks that the caller may do `action`, on the lock `name` if the action is
    /// about one lock. 403 `permission_denied` otherwise, saying why.
    pub fn authorize(&self, action: Action, name: Option<&str>) -> Result<(), ApiError> {
        if !self.role().permits(action) {
            return Err(denied(format!(
                "token {:?} has role {} and may not {}",
                self.name(),
                self.role(),
                action.describe()
            )));
        }
        if action == Action::Snapshot && !self.covers_everything() {
            return Err(denied(format!(
                "token {:?} is limited to some prefixes; a snapshot holds every lock",
                self.name()
            )));
        }
        // The metrics count every tenant's locks, sessions and traffic.
        if action == Action::Metrics && !self.covers_everything() {
            return Err(denied(format!(
                "token {:?} is limited to some prefixes; /metrics counts every lock, so it \
                 needs a token whose prefixes include \"\" (every lock)",
                self.name()
            )));
        }
        if let Some(name) = name {
            if !self.covers(name) {
                return Err(self.outside(name));
            }
        }
        Ok(())
    }

    fn outside(&self, name: &str) -> ApiError {
        denied(format!(
            "{name:?} is outside the prefixes of token {:?} ({:?})",
            self.name(),
            self.prefixes().collect::<Vec<_>>()
        ))
    }

    /// The prefixes to scan for a listing or watch of `requested`, cut down to the
    /// token's prefixes: `[requested]` if the token covers all of it, else the
    /// token's prefixes that lie within `requested` (none of them within another).
    /// 403 if the two do not overlap at all.
    pub fn ranges(&self, requested: &str) -> Result<Vec<String>, ApiError> {
        if self.covers(requested) {
            return Ok(vec![requested.to_owned()]);
        }
        let mut inside: Vec<&str> = self
            .prefixes()
            .filter(|p| p.starts_with(requested))
            .collect();
        if inside.is_empty() {
            return Err(self.outside(requested));
        }
        inside.sort_unstable();
        inside.dedup();
        // Sorted, a prefix comes right before the prefixes it contains: keep only the
        // outermost ones.
        let mut ranges: Vec<String> = Vec::with_capacity(inside.len());
        for p in inside {
            if !ranges
                .last()
                .is_some_and(|outer| p.starts_with(outer.as_str()))
            {
                ranges.push(p.to_owned());
            }
        }
        Ok(ranges)
    }

    /// Scopes an idempotency key to this caller, so that presenting someone else's
    /// `request_id` never returns their grant: `"<token name>/<id>"` (token names
    /// cannot contain `/`). Unchanged for the anonymous principal.
    pub fn scope_request_id(&self, id: Option<RequestId>) -> Result<Option<RequestId>, ApiError> {
        match id {
            Some(id) if !self.is_anonymous() => {
                RequestId::new(&format!("{}/{}", self.name(), id.as_str()))
                    .map(Some)
                    .map_err(|e| ApiError::new(ApiErrorKind::InvalidArgument, e.to_string()))
            }
            other => Ok(other),
        }
    }

    /// Counts one acquire attempt against the token's rate limit: 429
    /// `rate_limited` when its bucket is empty.
    pub fn take_acquire_attempt(&self) -> Result<(), ApiError> {
        self.take_acquire_attempt_at(Instant::now())
    }

    fn take_acquire_attempt_at(&self, now: Instant) -> Result<(), ApiError> {
        self.take_from(self.identity.bucket.as_ref(), "acquire attempts", now)
    }

    /// Takes one mutating request other than an acquire (renew, release, session
    /// open/keepalive/close, force-release) from the token's request rate, or
    /// refuses: 429 `rate_limited` (gRPC RESOURCE_EXHAUSTED).
    pub fn take_request(&self) -> Result<(), ApiError> {
        self.take_from(
            self.identity.request_bucket.as_ref(),
            "mutating requests",
            Instant::now(),
        )
    }

    fn take_from(
        &self,
        bucket: Option<&Mutex<TokenBucket>>,
        what: &str,
        now: Instant,
    ) -> Result<(), ApiError> {
        let Some(bucket) = bucket else {
            return Ok(());
        };
        let mut bucket = bucket.lock().unwrap_or_else(|e| e.into_inner());
        match bucket.take(now) {
            Ok(()) => Ok(()),
            Err(wait) => Err(ApiError::new(
                ApiErrorKind::RateLimited,
                format!(
                    "token {:?} made more than {} {what} per second (burst {}); \
                     retry in {} ms",
                    self.name(),
                    bucket.rate().per_second,
                    bucket.rate().burst,
                    wait.as_millis().max(1)
                ),
            )),
        }
    }

    /// What this token may hold at once; `None` with authentication off (only the
    /// core's global bounds apply then).
    pub fn quotas(&self) -> Option<Quotas> {
        self.identity.quotas
    }

    /// Counts one more open event stream (gRPC `Watch`, dashboard live stream)
    /// against the token's [`Quotas::max_streams`], for as long as the returned slot
    /// lives: 429 `resource_exhausted` when the token has that many open already.
    /// Every stream of the token counts, whichever connection it came on.
    pub fn open_stream(&self) -> Result<StreamSlot, ApiError> {
        let open = self.identity.streams.fetch_add(1, Ordering::AcqRel);
        let slot = StreamSlot {
            identity: self.identity.clone(),
        };
        match self.identity.quotas {
            Some(q) if open >= q.max_streams => Err(ApiError::new(
                ApiErrorKind::ResourceExhausted,
                format!(
                    "token {:?} has {} event streams open (watches and dashboard streams), \
                     its quota max_streams; close one first",
                    self.name(),
                    q.max_streams
                ),
            )),
            _ => Ok(slot),
        }
    }
}

/// One open event stream of a token ([`Principal::open_stream`]); dropping it gives
/// the slot back.
pub struct StreamSlot {
    identity: Arc<Identity>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.identity.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

fn denied(message: String) -> ApiError {
    ApiError::new(ApiErrorKind::PermissionDenied, message)
}

fn unauthenticated(message: impl Into<String>) -> ApiError {
    ApiError::new(ApiErrorKind::Unauthenticated, message)
}

/// Checks the caller found in `extensions` (put there by [`layer`]) for `action` on
/// the lock `name`: 401 if there is no authenticated caller, 403 if it may not.
/// For the dashboard and any route that is not an API handler.
pub fn authorize(
    extensions: &axum::http::Extensions,
    action: Action,
    name: Option<&str>,
) -> Result<Principal, ApiError> {
    let principal = extensions
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| unauthenticated("this request needs a token (Authorization: Bearer …)"))?;
    principal.authorize(action, name)?;
    Ok(principal)
}

/// The tokens the server accepts, ready to check requests against. Cheap to clone.
#[derive(Clone)]
pub struct Authenticator {
    tokens: Arc<[Principal]>,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl Authenticator {
    /// Validates `config`: names (`[A-Za-z0-9_.-]`, unique), hashes (64 hex digits,
    /// unique), prefixes (at least one each; each empty or a valid lock name). Each
    /// token gets a bucket of `default_rate` acquire attempts unless it has its own.
    pub fn new(
        config: &AuthConfig,
        default_rate: Option<RateLimit>,
    ) -> Result<Authenticator, ConfigError> {
        let limits = Limits {
            acquire_rate: default_rate,
            request_rate: None,
            ..Limits::default()
        };
        Authenticator::with_limits(config, &limits)
    }

    /// Checks the config like [`Authenticator::new`], with every per-token default
    /// (acquire rate, request rate, quotas) taken from `limits`.
    pub fn with_limits(config: &AuthConfig, limits: &Limits) -> Result<Authenticator, ConfigError> {
        let default_rate = limits.acquire_rate;
        let mut tokens = Vec::with_capacity(config.tokens.len());
        let mut names = std::collections::HashSet::new();
        let mut hashes = std::collections::HashSet::new();
        for t in &config.tokens {
            if !valid_token_name(&t.name) {
                return Err(invalid(format!(
                    "auth token name {:?}: use 1..={MAX_TOKEN_NAME_BYTES} of A-Z a-z 0-9 _ . -",
                    t.name
                )));
            }
            if t.name == "anonymous" {
                return Err(invalid(
                    "auth token name \"anonymous\" is reserved for requests when \
                     authentication is off",
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(format!(
                    "auth token name {:?} is used twice",
                    t.name
                )));
            }
            let hash = parse_hash(&t.sha256).ok_or_else(|| {
                invalid(format!(
                    "auth token {:?}: sha256 must be 64 hex digits (see `fencelock token new`)",
                    t.name
                ))
            })?;
            if !hashes.insert(hash) {
                return Err(invalid(format!(
                    "auth token {:?}: the same token hash is configured twice",
                    t.name
                )));
            }
            if t.prefixes.is_empty() {
                return Err(invalid(format!(
                    "auth token {:?}: give at least one prefix (\"\" for every lock)",
                    t.name
                )));
            }
            for p in &t.prefixes {
                if !p.is_empty() {
                    fencelock_core::LockName::new(p).map_err(|e| {
                        invalid(format!("auth token {:?}: prefix {p:?}: {e}", t.name))
                    })?;
                }
            }
            let rate = t.acquire_rate.or(default_rate);
            if let Some(rate) = rate {
                rate.check()
                    .map_err(|e| invalid(format!("auth token {:?}: {e}", t.name)))?;
            }
            let request_rate = t.request_rate.or(limits.request_rate);
            if let Some(rate) = request_rate {
                rate.check()
                    .map_err(|e| invalid(format!("auth token {:?}: {e}", t.name)))?;
            }
            let quotas = t.quotas.over(limits.quotas);
            quotas
                .check()
                .map_err(|e| invalid(format!("auth token {:?}: {e}", t.name)))?;
            tokens.push(Principal {
                identity: Arc::new(Identity {
                    name: t.name.as_str().into(),
                    role: t.role,
                    prefixes: t.prefixes.iter().map(|p| p.as_str().into()).collect(),
                    hash: Some(hash),
                    bucket: rate.map(|r| Mutex::new(TokenBucket::new(r, Instant::now()))),
                    request_bucket: request_rate
                        .map(|r| Mutex::new(TokenBucket::new(r, Instant::now()))),
                    quotas: Some(quotas),
                    streams: AtomicU32::new(0),
                    tenant: fencelock_core::Tenant::new(&t.name).ok(),
                }),
            });
        }
        Ok(Authenticator {
            tokens: tokens.into(),
        })
    }

    /// Whether any token is configured.
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// The principal of `token`, if it is a configured token. Compares the token's
    /// hash with every configured hash, in constant time each, without stopping at
    /// a match.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        let presented = sha256(token.as_bytes());
        let mut found = None;
        for p in self.tokens.iter() {
            let stored = p.identity.hash.as_ref()?;
            if constant_time_eq(&presented, stored) {
                found = Some(p.clone());
            }
        }
        found
    }

    /// The caller of a request: `Ok(None)` if it carries no credentials, an error if
    /// it carries bad ones. With authentication off, always the anonymous principal.
    /// (`uri` gives the host of an HTTP/2 request, which has no `Host` header.)
    pub fn principal(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Result<Option<Principal>, ApiError> {
        if !self.enabled() {
            return Ok(Some(Principal::anonymous()));
        }
        let (token, from_cookie) = match credentials(headers)? {
            Some(found) => found,
            None => return Ok(None),
        };
        let principal = self
            .authenticate(token)
            .ok_or_else(|| unauthenticated("unknown token"))?;
        if from_cookie && !safe_method(method) && !same_origin(uri, headers) {
            return Err(denied(
                "a request authenticated by cookie that changes state must come from this \
                 server's own pages (Origin does not match Host)"
                    .to_owned(),
            ));
        }
        Ok(Some(principal))
    }
}

fn safe_method(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether a browser says the request comes from this server's own pages.
fn same_origin(uri: &Uri, headers: &HeaderMap) -> bool {
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .or_else(|| uri.authority().map(|a| a.as_str()));
        // Origin is scheme://host[:port]; compare its authority with Host.
        let authority = origin.split_once("://").map(|(_, a)| a);
        return authority.is_some() && authority == host;
    }
    headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes() == b"same-origin")
}

/// The token of a request and whether it came from the cookie. The `Authorization`
/// header wins over the cookie; the first [`TOKEN_COOKIE`] counts.
fn credentials(headers: &HeaderMap) -> Result<Option<(&str, bool)>, ApiError> {
    if let Some(value) = headers.get(header::AUTHORIZATION) {
        let value = value
            .to_str()
            .map_err(|_| unauthenticated("the Authorization header is not text"))?;
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| unauthenticated("expected `Authorization: Bearer <token>`"))?;
        return checked(token).map(|t| Some((t, false)));
    }
    let cookies = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok);
    for c in cookies {
        if c.name() == TOKEN_COOKIE {
            // A cookie parsed from borrowed text borrows its value from it too.
            let Some(token) = c.value_raw() else { continue };
            return checked(token.trim_matches('"')).map(|t| Some((t, true)));
        }
    }
    Ok(None)
}

fn checked(token: &str) -> Result<&str, ApiError> {
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(unauthenticated("unknown token"));
    }
    Ok(token)
}

/// How the [`layer`] treats a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Anyone (health checks).
    Open,
    /// Dashboard pages: a principal if the credentials are good, else none.
    Page,
    /// Everything else: credentials required.
    Api,
}

fn gate(path: &str) -> Gate {
    match path {
        "/healthz" | "/readyz" | crate::openapi::PATH => Gate::Open,
        p if crate::grpc::is_reflection(p) => Gate::Open,
        "/" | "/ui" => Gate::Page,
        p if p.starts_with("/ui/") => Gate::Page,
        _ => Gate::Api,
    }
}

/// Whether a request is gRPC (answered with a gRPC status rather than JSON).
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// An error in the form the caller understands: a gRPC status for gRPC requests,
/// `{"error":{…}}` JSON otherwise (with `WWW-Authenticate` for 401).
pub(crate) fn refuse(grpc: bool, error: ApiError) -> Response {
    let unauthenticated = error.kind() == ApiErrorKind::Unauthenticated;
    let mut response = if grpc {
        tonic::Status::from(error).into_http::<axum::body::Body>()
    } else {
        error.into_response()
    };
    if unauthenticated {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"fencelock\""),
        );
    }
    response
}

/// The middleware behind every route: authenticates the request and puts its
/// [`Principal`] into the extensions, or refuses it with 401 (see the module docs
/// for the paths that are open).
pub async fn layer(
    State(auth): State<Authenticator>,
    mut request: Request,
    next: Next,
) -> Response {
    let gate = gate(request.uri().path());
    match auth.principal(request.method(), request.uri(), request.headers()) {
        Ok(Some(principal)) => {
            request.extensions_mut().insert(principal);
        }
        Ok(None) if gate == Gate::Api => {
            return refuse(
                is_grpc(request.headers()),
                unauthenticated("this request needs a token: send `Authorization: Bearer <token>`"),
            );
        }
        Ok(None) => {}
        Err(e) if gate == Gate::Api => {
            tracing::debug!(path = request.uri().path(), error = %e, "refused a request");
            return refuse(is_grpc(request.headers()), e);
        }
        Err(_) => {}
    }
    next.run(request).await
}

/// The caller of an HTTP handler, from the request extensions (401 if absent: the
/// check fails closed).
pub struct Caller(pub Principal);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Caller, ApiError> {
        parts
            .extensions
            .get::<Principal>()
            .cloned()
            .map(Caller)
            .ok_or_else(|| unauthenticated("this request needs a token (Authorization: Bearer …)"))
    }
}

/// The caller of a gRPC call (401 if absent: the check fails closed).
pub(crate) fn grpc_caller<T>(request: &tonic::Request<T>) -> Result<Principal, ApiError> {
    request
        .extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| unauthenticated("this call needs a token (authorization: Bearer …)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn config(tokens: &[(&str, Role, &[&str], &str)]) -> AuthConfig {
        AuthConfig {
            tokens: tokens
                .iter()
                .map(|(name, role, prefixes, token)| TokenConfig {
                    name: (*name).to_owned(),
                    role: *role,
                    prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
                    sha256: hash_token(token),
                    acquire_rate: None,
                    request_rate: None,
                    quotas: Default::default(),
                })
                .collect(),
        }
    }

    #[test]
    fn hash_is_sha256_hex() {
        assert_eq!(
            hash_token("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let t = new_token().unwrap();
        assert!(t.starts_with(TOKEN_PREFIX) && t.len() == TOKEN_PREFIX.len() + 64);
        assert_ne!(t, new_token().unwrap());
    }

    #[test]
    fn authenticates_only_configured_tokens() {
        let auth = Authenticator::new(
            &config(&[
                ("a", Role::Reader, &[""], "token-a"),
                ("b", Role::Admin, &["x:"], "token-b"),
            ]),
            None,
        )
        .unwrap();
        assert_eq!(auth.authenticate("token-a").unwrap().name(), "a");
        assert_eq!(auth.authenticate("token-b").unwrap().role(), Role::Admin);
        assert!(auth.authenticate("token-c").is_none());
        assert!(auth.authenticate("").is_none());
        assert!(auth.authenticate(&hash_token("token-a")).is_none());
    }

    #[test]
    fn credentials_from_header_or_cookie() {
        let auth =
            Authenticator::new(&config(&[("a", Role::Client, &[""], "sekrit")]), None).unwrap();
        let h2 = |origin: &str, method: Method| {
            // An HTTP/2 request: the host is in the URI, there is no Host header.
            let mut h = HeaderMap::new();
            h.insert(
                header::COOKIE,
                HeaderValue::from_static("fencelock_token=sekrit"),
            );
            h.insert(header::ORIGIN, HeaderValue::from_str(origin).unwrap());
            let uri: Uri = "https://h:1/v1/acquire".parse().unwrap();
            auth.principal(&method, &uri, &h).map(|p| p.is_some())
        };
        assert_eq!(h2("https://h:1", Method::POST), Ok(true));
        assert!(h2("https://evil:1", Method::POST).is_err());
        let check = |pairs: &[(&str, &str)], method: Method| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(
                    axum::http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            auth.principal(&method, &Uri::from_static("/"), &h)
                .map(|p| p.map(|p| p.name().to_owned()))
                .map_err(|e| e.kind())
        };
        use ApiErrorKind::*;
        let ok = Ok(Some("a".to_owned()));
        assert_eq!(check(&[], Method::GET), Ok(None));
        assert_eq!(
            check(&[("authorization", "Bearer sekrit")], Method::POST),
            ok
        );
        assert_eq!(
            check(&[("authorization", "bearer  sekrit ")], Method::POST),
            ok
        );
        assert_eq!(
            check(&[("authorization", "Bearer nope")], Method::GET),
            Err(Unauthenticated)
        );
        assert_eq!(
            check(&[("authorization", "Basic c2Vrcml0")], Method::GET),
            Err(Unauthenticated)
        );
        assert_eq!(
            check(&[("authorization", "sekrit")], Method::GET),
            Err(Unauthenticated)
        );
        assert_eq!(
            check(&[("cookie", "x=1; fencelock_token=sekrit")], Method::GET),
            ok
        );
        assert_eq!(
            check(&[("cookie", "fencelock_token=nope")], Method::GET),
            Err(Unauthenticated)
        );
        // A state change by cookie needs the server's own origin.
        let cookie = ("cookie", "fencelock_token=sekrit");
        assert_eq!(check(&[cookie], Method::POST), Err(PermissionDenied));
        assert_eq!(
            check(
                &[cookie, ("origin", "http://evil.example"), ("host", "h:1")],
                Method::POST
            ),
            Err(PermissionDenied)
        );
        assert_eq!(
            check(
                &[cookie, ("origin", "http://h:1"), ("host", "h:1")],
                Method::POST
            ),
            ok
        );
        assert_eq!(
            check(&[cookie, ("sec-fetch-site", "same-origin")], Method::POST),
            ok
        );
        assert_eq!(
            check(&[cookie, ("sec-fetch-site", "cross-site")], Method::POST),
            Err(PermissionDenied)
        );
    }

    #[test]
    fn roles_and_prefixes() {
        let auth = Authenticator::new(
            &config(&[
                ("r", Role::Reader, &["a:"], "r"),
                ("c", Role::Client, &["a:", "b:"], "c"),
                ("adm", Role::Admin, &["a:"], "adm"),
                ("root", Role::Admin, &[""], "root"),
            ]),
            None,
        )
        .unwrap();
        let p = |t| auth.authenticate(t).unwrap();
        let allowed = |t, action, name| p(t).authorize(action, name).is_ok();
        assert!(allowed("r", Action::Read, Some("a:1")));
        assert!(!allowed("r", Action::Read, Some("b:1")));
        assert!(!allowed("r", Action::Acquire, Some("a:1")));
        assert!(allowed("c", Action::Acquire, Some("b:1")));
        assert!(!allowed("c", Action::Acquire, Some("c:1")));
        assert!(!allowed("c", Action::ForceRelease, Some("a:1")));
        assert!(allowed("adm", Action::ForceRelease, Some("a:1")));
        assert!(!allowed("adm", Action::ForceRelease, Some("b:1")));
        assert!(!allowed("adm", Action::Snapshot, None));
        assert!(allowed("root", Action::Snapshot, None));
        // Issue 19 item 8: /metrics counts every tenant, so a reader limited to
        // some prefixes may not read it.
        assert!(!allowed("r", Action::Metrics, None));
        assert!(p("r")
            .authorize(Action::Metrics, None)
            .unwrap_err()
            .message()
            .contains("every lock"));
        assert!(allowed("root", Action::Metrics, None));
        assert!(!allowed("r", Action::Session, None));
        let err = p("c")
            .authorize(Action::ForceRelease, Some("a:1"))
            .unwrap_err();
        assert_eq!(err.kind(), ApiErrorKind::PermissionDenied);
        assert!(err.message().contains("client"), "{err}");
        assert!(Principal::anonymous()
            .authorize(Action::Snapshot, None)
            .is_ok());
    }

    /// A token's open streams are counted together, whichever kind; a closed one
    /// gives its slot back. Anonymous (authentication off) has no quota.
    #[test]
    fn streams_count_against_the_token_quota() {
        let limits = Limits {
            quotas: Quotas {
                max_streams: 2,
                ..Quotas::default()
            },
            ..Limits::default()
        };
        let auth =
            Authenticator::with_limits(&config(&[("r", Role::Reader, &["a:"], "r")]), &limits)
                .unwrap();
        let p = auth.authenticate("r").unwrap();
        let first = p.open_stream().unwrap();
        // The same token on another request is the same count.
        let _second = auth.authenticate("r").unwrap().open_stream().unwrap();
        let e = p.open_stream().err().unwrap();
        assert_eq!(e.kind(), ApiErrorKind::ResourceExhausted, "{e}");
        assert!(e.message().contains("max_streams"), "{e}");
        drop(first);
        assert!(p.open_stream().is_ok());
        let anonymous = Principal::anonymous();
        let _many: Vec<_> = (0..100).map(|_| anonymous.open_stream().unwrap()).collect();
    }

    #[test]
    fn ranges_cut_listings_to_the_prefixes() {
        let auth = Authenticator::new(
            &config(&[("c", Role::Client, &["a:x:", "a:y:", "a:x:1", "b:"], "c")]),
            None,
        )
        .unwrap();
        let p = auth.authenticate("c").unwrap();
        assert_eq!(p.ranges("a:x:9").unwrap(), ["a:x:9"]);
        assert_eq!(p.ranges("a:").unwrap(), ["a:x:", "a:y:"]);
        assert_eq!(p.ranges("").unwrap(), ["a:x:", "a:y:", "b:"]);
        assert_eq!(
            p.ranges("c:").unwrap_err().kind(),
            ApiErrorKind::PermissionDenied
        );
        assert_eq!(Principal::anonymous().ranges("q").unwrap(), ["q"]);
    }

    #[test]
    fn request_ids_are_scoped_to_the_token() {
        let auth =
            Authenticator::new(&config(&[("worker-1", Role::Client, &[""], "t")]), None).unwrap();
        let id = RequestId::new(&"x".repeat(128)).unwrap();
        let scoped = auth
            .authenticate("t")
            .unwrap()
            .scope_request_id(Some(id.clone()))
            .unwrap()
            .unwrap();
        assert_eq!(scoped.as_str(), format!("worker-1/{}", "x".repeat(128)));
        let anonymous = Principal::anonymous().scope_request_id(Some(id.clone()));
        assert_eq!(anonymous.unwrap(), Some(id));
    }

    #[test]
    fn bad_configs_are_refused() {
        let good = config(&[("a", Role::Client, &[""], "t")]);
        assert!(Authenticator::new(&good, None).is_ok());
        let mut cases = Vec::new();
        let mut c = good.clone();
        c.tokens[0].name = "a/b".into();
        cases.push(c);
        let mut c = good.clone();
        c.tokens[0].name = "anonymous".into();
        cases.push(c);
        let mut c = good.clone();
        c.tokens[0].sha256 = "abc".into();
        cases.push(c);
        let mut c = good.clone();
        c.tokens[0].prefixes.clear();
        cases.push(c);
        let mut c = good.clone();
        c.tokens[0].prefixes = vec!["a\u{7}".into()];
        cases.push(c);
        let mut c = good.clone();
        c.tokens.push(c.tokens[0].clone());
        cases.push(c);
        let mut c = good.clone();
        let mut twin = c.tokens[0].clone();
        twin.name = "b".into();
        c.tokens.push(twin);
        cases.push(c);
        for c in cases {
            assert!(Authenticator::new(&c, None).is_err(), "accepted {c:?}");
        }
    }

    #[test]
    fn acquire_attempts_are_rate_limited_per_token() {
        let mut c = config(&[
            ("a", Role::Client, &[""], "a"),
            ("b", Role::Client, &[""], "b"),
        ]);
        c.tokens[1].acquire_rate = Some(RateLimit {
            per_second: 1000,
            burst: 1000,
        });
        let auth = Authenticator::new(
            &c,
            Some(RateLimit {
                per_second: 2,
                burst: 3,
            }),
        )
        .unwrap();
        let a = auth.authenticate("a").unwrap();
        let b = auth.authenticate("b").unwrap();
        let start = Instant::now();
        for _ in 0..3 {
            a.take_acquire_attempt_at(start).unwrap();
        }
        let e = a.take_acquire_attempt_at(start).unwrap_err();
        assert_eq!(e.kind(), ApiErrorKind::RateLimited);
        assert!(e.message().contains("retry in 500 ms"), "{e}");
        // Another token has its own bucket.
        b.take_acquire_attempt_at(start).unwrap();
        // Refills at the rate.
        a.take_acquire_attempt_at(start + Duration::from_millis(500))
            .unwrap();
        assert!(a
            .take_acquire_attempt_at(start + Duration::from_millis(500))
            .is_err());
    }

    #[test]
    fn exposure_needs_auth_or_insecure() {
        let public: SocketAddr = "0.0.0.0:7420".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:7420".parse().unwrap();
        let v6: SocketAddr = "[::1]:7420".parse().unwrap();
        let none = AuthConfig::default();
        assert!(check_exposure(local, &none, false).is_ok());
        assert!(check_exposure(v6, &none, false).is_ok());
        assert!(check_exposure(public, &none, false).is_err());
        assert!(check_exposure(public, &none, true).is_ok());
        let some = config(&[("a", Role::Client, &[""], "t")]);
        assert!(check_exposure(public, &some, false).is_ok());
    }
}
