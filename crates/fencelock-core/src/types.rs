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
    /// A lock name contained an invisible character that changes how text looks or
    /// reads without being seen: a format character (Unicode category Cf: bidi
    /// overrides and isolates, direction marks, zero-width spaces and joiners, the
    /// byte order mark, the soft hyphen, …) or a line or paragraph separator
    /// (U+2028, U+2029). See [`LockName`].
    InvisibleCharacter(char),
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
            TextProblem::InvisibleCharacter(c) => write!(
                f,
                "{} must not contain U+{:04X} (an invisible format, direction or \
                 separator character, which would make one name look like another)",
                self.what, c as u32
            ),
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

/// Unicode's format characters (general category Cf, Unicode 15.1), and the line and
/// paragraph separators (Zl, Zp), as inclusive ranges. None of them is visible, and
/// the bidi ones reorder the text around them, so `a:\u{200B}x` reads as `a:x` and
/// `a:\u{202E}x:b` as `a:b:x`. Listed here rather than taken from a Unicode crate:
/// the core has no dependencies, and the category changes rarely.
const INVISIBLE: &[(char, char)] = &[
    ('\u{00AD}', '\u{00AD}'),
    ('\u{0600}', '\u{0605}'),
    ('\u{061C}', '\u{061C}'),
    ('\u{06DD}', '\u{06DD}'),
    ('\u{070F}', '\u{070F}'),
    ('\u{0890}', '\u{0891}'),
    ('\u{08E2}', '\u{08E2}'),
    ('\u{180E}', '\u{180E}'),
    ('\u{200B}', '\u{200F}'),
    ('\u{2028}', '\u{202E}'),
    ('\u{2060}', '\u{2064}'),
    ('\u{2066}', '\u{206F}'),
    ('\u{FEFF}', '\u{FEFF}'),
    ('\u{FFF9}', '\u{FFFB}'),
    ('\u{110BD}', '\u{110BD}'),
    ('\u{110CD}', '\u{110CD}'),
    ('\u{13430}', '\u{1343F}'),
    ('\u{1BCA0}', '\u{1BCA3}'),
    ('\u{1D173}', '\u{1D17A}'),
    ('\u{E0001}', '\u{E0001}'),
    ('\u{E0020}', '\u{E007F}'),
];

fn invisible(c: char) -> bool {
    // Everything below U+00AD is visible or a control character (checked apart).
    c >= '\u{00AD}' && INVISIBLE.iter().any(|&(lo, hi)| (lo..=hi).contains(&c))
}

/// A lock name: UTF-8, 1..=256 bytes, with no control character (U+0000..U+001F,
/// U+007F..U+009F) and no invisible character: no format character (Unicode
/// category Cf: bidi overrides and isolates U+202A..U+202E and U+2066..U+2069,
/// direction marks U+200E, U+200F, U+061C, zero-width space, joiners and word joiner
/// U+200B..U+200D, U+2060, the byte order mark U+FEFF, the soft hyphen U+00AD, tag
/// characters, …) and no line or paragraph separator (U+2028, U+2029). Every other
/// character is allowed, spaces and other scripts included. Such characters would
/// let one name pass for another on the dashboard, in logs and in audit entries
/// (`a:\u{200B}x` looks like `a:x`).
///
/// Hierarchy is by convention (`tenant:kind:id`); listing is by prefix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockName(std::sync::Arc<str>);

impl LockName {
    /// Validates `name` and wraps it. The error names the first refused character
    /// as `U+XXXX`.
    pub fn new(name: &str) -> Result<LockName, TextError> {
        check_text("lock name", name, false, MAX_NAME_BYTES)?;
        if let Some(c) = name.chars().find(|&c| invisible(c)) {
            return Err(TextError {
                what: "lock name",
                problem: TextProblem::InvisibleCharacter(c),
            });
        }
        Ok(LockName(name.into()))
    }

    /// Wraps a name read back from storage (log records, snapshots) with the rules
    /// every version accepted: length and control characters only. Names with
    /// invisible characters were accepted before [`LockName::new`] refused them, and
    /// a data directory that holds one must still recover.
    pub fn recorded(name: &str) -> Result<LockName, TextError> {
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

/// Longest election value, in bytes of UTF-8.
pub const MAX_VALUE_BYTES: usize = 4096;

/// How a grant holds its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Mode {
    /// A writer: never together with a shared holder (on a lock with `limit` 1, the
    /// only holder; on a semaphore, one of at most `limit` exclusive holders).
    #[default]
    Exclusive,
    /// A reader: any number of readers together (up to `limit`, or up to
    /// [`Config::max_limit`](crate::Config::max_limit) on a lock with `limit` 1),
    /// never with an exclusive holder.
    Shared,
}

impl Mode {
    /// `"exclusive"` or `"shared"`, as on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Exclusive => "exclusive",
            Mode::Shared => "shared",
        }
    }

    /// Parses `"exclusive"` or `"shared"`.
    pub fn parse(text: &str) -> Option<Mode> {
        match text {
            "exclusive" => Some(Mode::Exclusive),
            "shared" => Some(Mode::Shared),
            _ => None,
        }
    }
}

/// An election value (what a leader publishes, e.g. its address): UTF-8, at most
/// [`MAX_VALUE_BYTES`] bytes, no control characters, may be empty.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct Value(std::sync::Arc<str>);

impl Value {
    /// Validates `value` and wraps it.
    pub fn new(value: &str) -> Result<Value, TextError> {
        check_text("value", value, true, MAX_VALUE_BYTES)?;
        Ok(Value(value.into()))
    }

    /// The value as text.
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
        assert!(LockName::new("café:ünïcode 名前 with spaces").is_ok());
        assert!(Owner::new("").is_ok());
        assert!(Owner::new(&"o".repeat(1025)).is_err());
        assert!(Reason::new("").is_err());
    }

    /// Issue 19 item 8: `a:\u{200B}x` looked like `a:x`, and bidi overrides reorder
    /// what a name shows.
    #[test]
    fn names_refuse_invisible_characters_by_code_point() {
        for c in [
            '\u{200B}',
            '\u{200C}',
            '\u{200D}',
            '\u{200E}',
            '\u{200F}',
            '\u{202A}',
            '\u{202E}',
            '\u{2066}',
            '\u{2069}',
            '\u{061C}',
            '\u{2060}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{2028}',
            '\u{E0041}',
        ] {
            let name = format!("a:{c}x");
            let e = LockName::new(&name).unwrap_err();
            assert_eq!(e.problem(), TextProblem::InvisibleCharacter(c), "{name:?}");
            let code = format!("U+{:04X}", c as u32);
            assert!(e.to_string().contains(&code), "{e} names {code}");
            // Read back from storage, a name some earlier version accepted still loads.
            assert!(LockName::recorded(&name).is_ok());
        }
        assert_eq!(
            LockName::recorded("a\u{0}b").unwrap_err().problem(),
            TextProblem::ControlCharacter
        );
        // Neighbours of the refused ranges stay allowed.
        for ok in [
            "a\u{00AC}",
            "a\u{200A}",
            "a\u{2030}",
            "a\u{2065}",
            "a\u{FEFE}",
            "a\u{FF10}",
        ] {
            assert!(LockName::new(ok).is_ok(), "{ok:?}");
        }
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
