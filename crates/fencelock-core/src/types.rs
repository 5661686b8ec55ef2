//! Value types that can only be built valid: names, fences, tokens, owner text.

use std::fmt;
use std::str::FromStr;

/// Longest lock name, in bytes of UTF-8.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest owner description, in bytes of UTF-8.
pub const MAX_OWNER_BYTES: usize = 1024;
/// Longest idempotency key (`request_id`), in bytes of UTF-8. Room for a server that
/// scopes a client's key (the server accepts 128 bytes from clients) by its caller's
/// name (up to 64 bytes and a separator).
pub const MAX_REQUEST_ID_BYTES: usize = 256;
/// Longest reason text for a forced release, in bytes of UTF-8.
pub const MAX_REASON_BYTES: usize = 1024;

/// Why a piece of text was refused as a name, owner, request id or reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextError {
    what: &'static str,
    problem: TextProblem,
}

/// The specific problem with refused text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TextProblem {
    /// The text was empty where at least one byte is required.
    Empty,
    /// The text was longer than the given number of bytes.
    TooLong(usize),
    /// The text contained a control character (U+0000..U+001F, U+007F..U+009F).
    ControlCharacter,
}

impl TextError {
    /// The specific problem.
    pub fn problem(&self) -> TextProblem {
        self.problem
    }
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.problem {
            TextProblem::Empty => write!(f, "{} must not be empty", self.what),
            TextProblem::TooLong(max) => write!(f, "{} must be at most {max} bytes", self.what),
            TextProblem::ControlCharacter => {
                write!(f, "{} must not contain control characters", self.what)
            }
        }
    }
}

impl std::error::Error for TextError {}

fn check_text(what: &'static str, s: &str, allow_empty: bool, max: usize) -> Result<(), TextError> {
    let problem = if s.is_empty() && !allow_empty {
        Some(TextProblem::Empty)
    } else if s.len() > max {
        Some(TextProblem::TooLong(max))
    } else if s.chars().any(char::is_control) {
        Some(TextProblem::ControlCharacter)
    } else {
        None
    };
    match problem {
        Some(problem) => Err(TextError { what, problem }),
        None => Ok(()),
    }
}

/// A lock name: UTF-8, 1..=256 bytes, no control characters.
///
/// Hierarchy is by convention (`tenant:kind:id`); listing is by prefix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockName(std::sync::Arc<str>);

impl LockName {
    /// Validates `name` and wraps it.
    pub fn new(name: &str) -> Result<LockName, TextError> {
        check_text("lock name", name, false, MAX_NAME_BYTES)?;
        Ok(LockName(name.into()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Free-form text describing who holds a lock (host, pid, job), at most 1 KiB.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct Owner(std::sync::Arc<str>);

impl Owner {
    /// Validates `owner` (may be empty) and wraps it.
    pub fn new(owner: &str) -> Result<Owner, TextError> {
        check_text("owner", owner, true, MAX_OWNER_BYTES)?;
        Ok(Owner(owner.into()))
    }

    /// The owner text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The principal (token name, `anonymous` with authentication off) a session, grant
/// or queued request belongs to: 1..=256 bytes, no control characters. The core keys
/// per-principal quotas and session ownership by it; it is never a secret.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tenant(std::sync::Arc<str>);

/// Longest [`Tenant`] name, in bytes.
pub const MAX_TENANT_BYTES: usize = 256;

impl Tenant {
    /// Validates `name` and wraps it.
    pub fn new(name: &str) -> Result<Tenant, TextError> {
        check_text("principal", name, false, MAX_TENANT_BYTES)?;
        Ok(Tenant(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A client-chosen idempotency key for acquire, 1..=128 bytes, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(Box<str>);

impl RequestId {
    /// Validates `id` and wraps it.
    pub fn new(id: &str) -> Result<RequestId, TextError> {
        check_text("request_id", id, false, MAX_REQUEST_ID_BYTES)?;
        Ok(RequestId(id.into()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The reason an operator gives for a forced release: 1..=1024 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reason(Box<str>);

impl Reason {
    /// Validates `reason` and wraps it.
    pub fn new(reason: &str) -> Result<Reason, TextError> {
        check_text("reason", reason, false, MAX_REASON_BYTES)?;
        Ok(Reason(reason.into()))
    }

    /// The reason as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A fencing token: strictly increasing across every grant the server ever makes.
///
/// Zero is never a fence, so a resource can start from "last seen = 0".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(u64);

impl Fence {
    /// Wraps a non-zero value.
    pub fn new(value: u64) -> Option<Fence> {
        (value != 0).then_some(Fence(value))
    }

    /// The numeric value.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why text could not be parsed as a 128-bit token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenParseError;

impl fmt::Display for TokenParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("expected 32 hexadecimal digits")
    }
}

impl std::error::Error for TokenParseError {}

fn parse_hex128(s: &str) -> Result<u128, TokenParseError> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(TokenParseError);
    }
    u128::from_str_radix(s, 16).map_err(|_| TokenParseError)
}

macro_rules! token_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u128);

        impl $name {
            /// Wraps 128 bits. The server draws them from a secure random source;
            /// the core never invents them, so it stays deterministic.
            pub fn from_u128(bits: u128) -> $name {
                $name(bits)
            }

            /// The 128 bits.
            pub fn as_u128(self) -> u128 {
                self.0
            }
        }

        impl fmt::Display for $name {
            /// 32 lower-case hexadecimal digits.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:032x}", self.0)
            }
        }

        impl FromStr for $name {
            type Err = TokenParseError;
            fn from_str(s: &str) -> Result<$name, TokenParseError> {
                parse_hex128(s).map($name)
            }
        }
    };
}

token_type!(
    /// Identifies one grant (or one queued acquire). Renew and release require it.
    OwnerToken
);
token_type!(
    /// Identifies a session: a lease that can hold many locks.
    SessionId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(LockName::new("inventory:item:1234").is_ok());
        assert_eq!(LockName::new("").unwrap_err().problem(), TextProblem::Empty);
        assert_eq!(
            LockName::new(&"x".repeat(257)).unwrap_err().problem(),
            TextProblem::TooLong(256)
        );
        assert!(LockName::new(&"é".repeat(128)).is_ok());
        assert_eq!(
            LockName::new("a\nb").unwrap_err().problem(),
            TextProblem::ControlCharacter
        );
        assert_eq!(
            LockName::new("a\u{85}b").unwrap_err().problem(),
            TextProblem::ControlCharacter
        );
        assert!(Owner::new("").is_ok());
        assert!(Owner::new(&"o".repeat(1025)).is_err());
        assert!(Reason::new("").is_err());
    }

    #[test]
    fn tokens_round_trip_as_hex() {
        let t = OwnerToken::from_u128(0xdead_beef);
        let s = t.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<OwnerToken>().unwrap(), t);
        assert!("xyz".parse::<OwnerToken>().is_err());
        assert!("+0000000000000000000000000000000"
            .parse::<OwnerToken>()
            .is_err());
        assert!(Fence::new(0).is_none());
    }
}
