//! How grants are laid out in etcd's key space, and the owner token that names one.
//!
//! A grant is the key `<prefix>/<escaped lock name>/<escaped request id>`, with the
//! value `limit=<n>\nowner=<owner>`. Escaping keeps every byte outside a small safe
//! set (and `%` itself) as `%XX`, so an escaped name never contains `/`: the keys of
//! lock `a/b` live under `<prefix>/a%2Fb/`, a range that no key of lock `a` or `b` is
//! in, and no two names share a range.

use std::fmt::Write as _;

use fencelock_backend::{Error, ErrorKind};

/// `text` with every byte outside `[A-Za-z0-9-_.:~@+=,]` written as `%XX` (upper-case
/// hex). Injective, and the result never contains `/`.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.:~@+=,".contains(&byte) {
            out.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// The inverse of [`escape`]; `None` for text `escape` cannot have produced.
pub(crate) fn unescape(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'%' {
            let hex = tail.get(..2)?;
            let hex = std::str::from_utf8(hex).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(first);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// The key range of one lock: `<prefix>/<escaped name>/`, and the first key after
/// every key that starts with it.
pub(crate) fn lock_dir(prefix: &str, name: &str) -> (Vec<u8>, Vec<u8>) {
    let dir = format!("{prefix}/{}/", escape(name)).into_bytes();
    let mut end = dir.clone();
    // The last byte is '/', so adding one never carries.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    (dir, end)
}

/// What a grant's key says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The limit it asked for.
    pub(crate) limit: u32,
    /// A reader of a reader-writer lock.
    pub(crate) shared: bool,
    /// A leader's (or candidate's) value; `None` for a plain lock.
    pub(crate) value: Option<String>,
    /// Who asked.
    pub(crate) owner: String,
}

/// The value stored in a grant's key: `limit=<n>`, then `mode=shared` for a reader and
/// `value=<v>` for a candidate, then `owner=<owner>`, one per line (none of them can
/// contain a newline: control characters are refused). A plain lock's value is the
/// two lines it has always been.
pub(crate) fn value(entry: &Entry) -> Vec<u8> {
    let mut text = format!("limit={}\n", entry.limit);
    if entry.shared {
        text.push_str("mode=shared\n");
    }
    if let Some(value) = &entry.value {
        let _ = writeln!(text, "value={value}");
    }
    text.push_str("owner=");
    text.push_str(&entry.owner);
    text.into_bytes()
}

/// The [`Entry`] of a grant's value; `None` for a key this backend did not write.
pub(crate) fn parse_value(value: &[u8]) -> Option<Entry> {
    let text = std::str::from_utf8(value).ok()?;
    let (limit, mut rest) = text.split_once('\n')?;
    let limit = limit.strip_prefix("limit=")?.parse().ok()?;
    let mut shared = false;
    if let Some(after) = rest.strip_prefix("mode=shared\n") {
        shared = true;
        rest = after;
    }
    let mut candidate = None;
    if let Some(after) = rest.strip_prefix("value=") {
        let (value, after) = after.split_once('\n')?;
        candidate = Some(value.to_owned());
        rest = after;
    }
    let owner = rest.strip_prefix("owner=")?;
    if owner.contains('\n') {
        return None;
    }
    Some(Entry {
        limit,
        shared,
        value: candidate,
        owner: owner.to_owned(),
    })
}

/// The owner token of a grant: `<lease id>:<create revision>:<escaped request id>`.
/// With the lock name it names the grant's key, and the lease and revision that key
/// must still have for the grant to be held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    /// The grant's etcd lease: its own, or its session's.
    pub(crate) lease_id: i64,
    /// Held on a session's lease (`s` before the lease id): releasing deletes the key
    /// but leaves the lease to the session.
    pub(crate) session: bool,
    /// The key's create revision (= the fence).
    pub(crate) revision: i64,
    /// The escaped request id: the last part of the key.
    pub(crate) escaped_request_id: String,
}

impl Token {
    /// The token's text.
    pub(crate) fn encode(&self) -> String {
        format!(
            "{}{}:{}:{}",
            if self.session { "s" } else { "" },
            self.lease_id,
            self.revision,
            self.escaped_request_id
        )
    }

    /// Parses a token made by [`Token::encode`]; `InvalidArgument` for anything else.
    pub(crate) fn parse(text: &str) -> Result<Token, Error> {
        let malformed = || {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("{text:?} is not an owner token of the etcd backend"),
            )
        };
        let (session, text_after) = match text.strip_prefix('s') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let mut parts = text_after.splitn(3, ':');
        let lease_id: i64 = parts
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(malformed)?;
        let revision: i64 = parts
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(malformed)?;
        let escaped_request_id = parts.next().ok_or_else(malformed)?;
        // Only what `escape` makes: a token must not name a key outside its lock's
        // range (a `/` would reach into another "directory").
        if lease_id <= 0
            || revision <= 0
            || escaped_request_id.is_empty()
            || unescape(escaped_request_id)
                .map(|rid| escape(&rid))
                .as_deref()
                != Some(escaped_request_id)
        {
            return Err(malformed());
        }
        Ok(Token {
            lease_id,
            session,
            revision,
            escaped_request_id: escaped_request_id.to_owned(),
        })
    }

    /// The grant's key for lock `name` under `prefix`.
    pub(crate) fn key(&self, prefix: &str, name: &str) -> Vec<u8> {
        let (mut key, _) = lock_dir(prefix, name);
        key.extend_from_slice(self.escaped_request_id.as_bytes());
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_is_reversible_and_keeps_slashes_out() {
        for text in [
            "a",
            "a/b",
            "a%2Fb",
            "job:daily-settlement",
            "ünïcödé/名前",
            "%",
            "100%",
            " space ",
            "",
        ] {
            let escaped = escape(text);
            assert!(!escaped.contains('/'), "{text:?} escaped to {escaped:?}");
            assert_eq!(unescape(&escaped).as_deref(), Some(text), "{escaped:?}");
        }
        assert_eq!(escape("a/b"), "a%2Fb");
        assert_eq!(escape("a%2Fb"), "a%252Fb");
        assert_eq!(unescape("%2"), None);
        assert_eq!(unescape("%zz"), None);
    }

    #[test]
    fn lock_ranges_of_different_names_are_disjoint() {
        let names = ["a", "b", "a/b", "a/", "a%2Fb", "ab", "a/b/c", "ü", "ü/b"];
        for x in names {
            let (dir, end) = lock_dir("p", x);
            for y in names {
                let key = Token {
                    lease_id: 1,
                    session: false,
                    revision: 1,
                    escaped_request_id: escape("r/1"),
                }
                .key("p", y);
                let inside = key.as_slice() >= dir.as_slice() && key.as_slice() < end.as_slice();
                assert_eq!(inside, x == y, "a key of {y:?} inside the range of {x:?}");
            }
        }
    }

    #[test]
    fn tokens_round_trip_and_refuse_foreign_text() {
        let token = Token {
            lease_id: 7587869,
            session: false,
            revision: 42,
            escaped_request_id: escape("req:1/2"),
        };
        assert_eq!(Token::parse(&token.encode()).expect("parses"), token);
        let held = Token {
            session: true,
            ..token.clone()
        };
        assert_eq!(held.encode(), "s7587869:42:req:1%2F2");
        assert_eq!(Token::parse(&held.encode()).expect("parses"), held);
        for bad in [
            "", "1:2", "x:2:r", "1:x:r", "0:2:r", "1:-2:r", "1:2:", "1:2:a/b", "1:2:%2", "1:2:a b",
            "s", "s:1:r", "ss1:2:r", "S1:2:r",
        ] {
            let e = Token::parse(bad).expect_err(bad);
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}");
        }
    }

    #[test]
    fn values_round_trip() {
        let entry = |limit, shared, value: Option<&str>, owner: &str| Entry {
            limit,
            shared,
            value: value.map(str::to_owned),
            owner: owner.to_owned(),
        };
        for e in [
            entry(3, false, None, "host:12"),
            entry(1, false, None, ""),
            entry(1, true, None, "reader"),
            entry(1, false, Some("10.0.0.1:80"), "leader"),
            entry(1, false, Some(""), ""),
        ] {
            assert_eq!(parse_value(&value(&e)).as_ref(), Some(&e));
        }
        // What earlier versions wrote.
        assert_eq!(
            parse_value(b"limit=3\nowner=host:12"),
            Some(entry(3, false, None, "host:12"))
        );
        assert_eq!(parse_value(b"something else"), None);
        assert_eq!(parse_value(b"limit=x\nowner="), None);
        assert_eq!(parse_value(b"limit=1\nmode=odd\nowner="), None);
    }
}
