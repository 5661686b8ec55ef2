//! Server-side limits that protect the server from a client: body size, connections
//! (authenticated, unauthenticated, per IP, idle), HTTP/2 streams per connection,
//! acquire attempts and other mutating requests per token (token buckets), and
//! per-token quotas of sessions, held locks, waiters and streams.
//!
//! The lock table's own bounds (waiters per lock and in total, locks per session,
//! sessions, locks) are the core's (`fencelock_core::Config`), enforced inside the
//! state machine; these here act before a request reaches the engine.

use std::time::{Duration, Instant};

use crate::startup::ConfigError;

/// Default for [`Limits::max_body_bytes`].
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 * 1024;
/// Default for [`Limits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default for [`Limits::max_streams_per_connection`].
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// Default for [`Limits::acquire_rate`]: per token, 1000 attempts a second with
/// bursts of 2000.
pub const DEFAULT_ACQUIRE_RATE: RateLimit = RateLimit {
    per_second: 1000,
    burst: 2000,
};
/// Default for [`Limits::tls_handshake_timeout`].
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`Limits::request_rate`]: per token, 5000 mutating requests other
/// than acquires a second (renewals, releases, sessions, forced releases) with
/// bursts of 10000.
pub const DEFAULT_REQUEST_RATE: RateLimit = RateLimit {
    per_second: 5000,
    burst: 10_000,
};
/// Default for [`Limits::max_unauthenticated_connections`].
pub const DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS: usize = 256;
/// Default for [`Limits::auth_timeout`].
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Default for [`Limits::max_connections_per_ip`].
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 2000;
/// Default for [`Limits::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Default for [`Limits::quotas`].
pub const DEFAULT_QUOTAS: Quotas = Quotas {
    max_sessions: 1000,
    max_held_locks: 10_000,
    max_waiters: 10_000,
    max_streams: 16,
};

/// Limits applied at the edge of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest HTTP request body and largest gRPC message, in bytes (413
    /// `payload_too_large`; gRPC OUT_OF_RANGE).
    pub max_body_bytes: usize,
    /// Most connections served at once. A connection beyond it is answered with 503
    /// `unavailable` (plain HTTP) or closed (TLS) right away.
    pub max_connections: usize,
    /// Most concurrent HTTP/2 streams (gRPC calls) per connection; a client that
    /// wants more waits for a stream to end (HTTP/1.1 has one at a time anyway). On a
    /// `flw/1` connection: most acquires in flight (one more is refused with
    /// `resource_exhausted`), and as many again of other requests.
    pub max_streams_per_connection: u32,
    /// Acquire attempts per token (429 `rate_limited` beyond it); `None`: no limit.
    /// Applies only to configured tokens: with authentication off nothing is rate
    /// limited. A token's own `acquire_rate` overrides it.
    pub acquire_rate: Option<RateLimit>,
    /// Longest a TLS handshake may take before its connection is closed.
    pub tls_handshake_timeout: Duration,
    /// Mutating requests other than acquires per token (renew, release, session
    /// open/keepalive/close, force-release; 429 `rate_limited` beyond it); `None`: no
    /// limit. Like `acquire_rate`, only for configured tokens.
    pub request_rate: Option<RateLimit>,
    /// Most connections at once that have not yet authenticated (sent a `flw/1`
    /// Hello that succeeded, or an HTTP request that passed authentication). They
    /// have their own pool, apart from `max_connections`, so they can never take an
    /// authenticated client's place; when it is full, the oldest of them is closed
    /// to make room, so a new client always gets in.
    pub max_unauthenticated_connections: usize,
    /// Longest a connection may stay unauthenticated before it is closed.
    pub auth_timeout: Duration,
    /// Most connections at once from one IP address, authenticated or not.
    pub max_connections_per_ip: usize,
    /// Longest a connection with no request in flight is kept open (HTTP/2
    /// connections that send nothing, idle `flw/1` connections that only ping).
    pub idle_timeout: Duration,
    /// What one token may hold at once, unless its own config says otherwise; with
    /// authentication off none apply (the core's global bounds still do).
    pub quotas: Quotas,
}

/// What one token may hold at once (see [`Limits::quotas`]). Over a quota, a request
/// is refused with `resource_exhausted` and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    /// Open sessions.
    pub max_sessions: u32,
    /// Held grants (locks and semaphore slots).
    pub max_held_locks: u32,
    /// Queued acquires.
    pub max_waiters: u32,
    /// Open event streams: gRPC and `flw/1` watches, and dashboard live streams.
    pub max_streams: u32,
}

impl Default for Quotas {
    fn default() -> Quotas {
        DEFAULT_QUOTAS
    }
}

impl Quotas {
    /// Checks that every quota is at least 1.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.max_sessions == 0
            || self.max_held_locks == 0
            || self.max_waiters == 0
            || self.max_streams == 0
        {
            return Err(ConfigError::invalid(
                "quotas: max_sessions, max_held_locks, max_waiters and max_streams must \
                 each be at least 1",
            ));
        }
        Ok(())
    }
}

/// One token's own quotas: each field left `None` takes the default of
/// [`Limits::quotas`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaOverrides {
    /// Overrides [`Quotas::max_sessions`].
    pub max_sessions: Option<u32>,
    /// Overrides [`Quotas::max_held_locks`].
    pub max_held_locks: Option<u32>,
    /// Overrides [`Quotas::max_waiters`].
    pub max_waiters: Option<u32>,
    /// Overrides [`Quotas::max_streams`].
    pub max_streams: Option<u32>,
}

impl QuotaOverrides {
    /// These overrides over `defaults`.
    pub fn over(&self, defaults: Quotas) -> Quotas {
        Quotas {
            max_sessions: self.max_sessions.unwrap_or(defaults.max_sessions),
            max_held_locks: self.max_held_locks.unwrap_or(defaults.max_held_locks),
            max_waiters: self.max_waiters.unwrap_or(defaults.max_waiters),
            max_streams: self.max_streams.unwrap_or(defaults.max_streams),
        }
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_streams_per_connection: DEFAULT_MAX_STREAMS_PER_CONNECTION,
            acquire_rate: Some(DEFAULT_ACQUIRE_RATE),
            tls_handshake_timeout: DEFAULT_TLS_HANDSHAKE_TIMEOUT,
            request_rate: Some(DEFAULT_REQUEST_RATE),
            max_unauthenticated_connections: DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
            auth_timeout: DEFAULT_AUTH_TIMEOUT,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            quotas: DEFAULT_QUOTAS,
        }
    }
}

impl Limits {
    /// Checks that every limit is usable (each at least 1).
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::invalid(
                "limits.max_body_bytes must be at least 1024",
            ));
        }
        if self.max_connections == 0 || self.max_streams_per_connection == 0 {
            return Err(ConfigError::invalid(
                "limits.max_connections and limits.max_streams_per_connection must be at least 1",
            ));
        }
        if self.tls_handshake_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "tls.handshake_timeout_ms must be at least 1",
            ));
        }
        if self.max_unauthenticated_connections == 0 || self.max_connections_per_ip == 0 {
            return Err(ConfigError::invalid(
                "limits.max_unauthenticated_connections and \
                        limits.max_connections_per_ip must be at least 1",
            ));
        }
        if self.auth_timeout.is_zero() || self.idle_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "limits.auth_timeout_ms and limits.idle_timeout_ms must be at least 1",
            ));
        }
        for rate in [self.acquire_rate, self.request_rate].into_iter().flatten() {
            rate.check()?;
        }
        self.quotas.check()
    }
}

/// A rate: `per_second` on average, up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Sustained attempts per second (at least 1).
    pub per_second: u32,
    /// Attempts allowed at once after a quiet period (at least 1).
    pub burst: u32,
}

impl RateLimit {
    /// Checks that both numbers are at least 1.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.per_second == 0 || self.burst == 0 {
            return Err(ConfigError::invalid(
                "rate: per_second and burst must be at least 1 \
                        (leave the rate out for no limit)",
            ));
        }
        Ok(())
    }
}

/// A token bucket: holds up to `burst` tokens, refilled at `per_second`; each
/// attempt takes one. Time is an argument, so tests need no clock.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: RateLimit,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: RateLimit, now: Instant) -> TokenBucket {
        TokenBucket {
            rate,
            tokens: f64::from(rate.burst),
            at: now,
        }
    }

    /// The bucket's rate.
    pub fn rate(&self) -> RateLimit {
        self.rate
    }

    /// Takes one token at `now`, or says how long until one is there. `now` before
    /// the last call counts as the last call (time never runs backwards here).
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = self.at.max(now);
        let per_second = f64::from(self.rate.per_second.max(1));
        self.tokens = (self.tokens + elapsed * per_second).min(f64::from(self.rate.burst));
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / per_second))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_a_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(
            RateLimit {
                per_second: 10,
                burst: 5,
            },
            t0,
        );
        for _ in 0..5 {
            b.take(t0).unwrap();
        }
        assert_eq!(b.take(t0), Err(Duration::from_millis(100)));
        let t1 = t0 + Duration::from_millis(100);
        b.take(t1).unwrap();
        assert!(b.take(t1).is_err());
        // A long pause refills only up to the burst.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..5 {
            b.take(t2).unwrap();
        }
        assert!(b.take(t2).is_err());
        // An earlier instant changes nothing.
        assert!(b.take(t0).is_err());
    }

    #[test]
    fn limits_are_checked() {
        assert!(Limits::default().check().is_ok());
        let bad = [
            Limits {
                max_body_bytes: 10,
                ..Limits::default()
            },
            Limits {
                max_connections: 0,
                ..Limits::default()
            },
            Limits {
                max_streams_per_connection: 0,
                ..Limits::default()
            },
            Limits {
                acquire_rate: Some(RateLimit {
                    per_second: 0,
                    burst: 1,
                }),
                ..Limits::default()
            },
        ];
        for l in bad {
            assert!(l.check().is_err(), "{l:?}");
        }
    }
}
