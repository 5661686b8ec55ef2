//! Messages for people: the client library's and the server's errors said in the
//! words of the command line (the flag the user typed, not the wire field; "not
//! authenticated" for a 401, not `permission_denied`), with the exit code each
//! failure gets.

use fencelock::{Error, ErrorKind, LockInfo};

use crate::exit;
use crate::http_get::{HttpStatus, Unreachable};
use crate::remote::{human_ms, Failure};

/// The message for a client library error.
pub fn client_error(e: &Error) -> String {
    let message = e.message();
    match e.kind() {
        ErrorKind::PermissionDenied if is_unauthenticated(message) => unauthenticated(message),
        ErrorKind::PermissionDenied => format!("not allowed: {message}"),
        ErrorKind::InvalidArgument => flag_message(message),
        ErrorKind::Unavailable => format!("server unavailable: {message}"),
        ErrorKind::NotFound | ErrorKind::NotHeld | ErrorKind::LockLost => message.to_owned(),
        _ => e.to_string(),
    }
}

/// Whether a refusal is the server's 401 (no token, or one it does not know) rather
/// than its 403 (a known token that may not do this). Over gRPC both arrive as
/// `PermissionDenied`; the server's 401 texts all speak of the token itself.
fn is_unauthenticated(message: &str) -> bool {
    message == "unknown token"
        || message.contains("needs a token")
        || message.contains("Authorization")
        || message.contains("authorization: Bearer")
}

fn unauthenticated(message: &str) -> String {
    format!(
        "not authenticated: {message} (give a token the server knows with --token or \
         FENCELOCK_TOKEN)"
    )
}

/// The server's wire field names and the flags that set them, with whether the value
/// is a duration in milliseconds.
const FLAGS: &[(&str, &str, bool)] = &[
    ("session ttl_ms", "--ttl", true),
    ("ttl_ms", "--ttl", true),
    ("wait_ms", "--wait", true),
    ("lock_delay_ms", "--lock-delay", true),
    ("limit", "--limit", false),
    ("owner", "--owner", false),
    ("name", "the lock name", false),
];

/// An `invalid_argument` message in the flags' words: `ttl_ms must be between 10 and
/// 86400000, got 5` → `--ttl must be at least 10ms (got 5ms)`; `name: …` → `the lock
/// name: …`. Other messages are returned as they are.
pub fn flag_message(message: &str) -> String {
    for &(field, flag, duration) in FLAGS {
        if let Some(rest) = message.strip_prefix(field) {
            if let Some(range) = rest.strip_prefix(" must be between ") {
                if let Some(text) = range_message(flag, range, duration) {
                    return text;
                }
            }
            if let Some(detail) = rest.strip_prefix(": ") {
                return format!("{flag}: {detail}");
            }
            if rest.starts_with(" must ") {
                return format!("{flag}{rest}");
            }
        }
    }
    message.to_owned()
}

/// `MIN and MAX, got VALUE` as "FLAG must be at least/at most …".
fn range_message(flag: &str, range: &str, duration: bool) -> Option<String> {
    let (min, rest) = range.split_once(" and ")?;
    let (max, got) = rest.split_once(", got ")?;
    let [min, max, got] = [min, max, got].map(|n| n.trim().parse::<u64>());
    let (min, max, got) = (min.ok()?, max.ok()?, got.ok()?);
    let show = |n: u64| {
        if duration {
            human_ms(n)
        } else {
            n.to_string()
        }
    };
    Some(if got < min {
        format!("{flag} must be at least {} (got {})", show(min), show(got))
    } else {
        format!("{flag} must be at most {} (got {})", show(max), show(got))
    })
}

/// Who holds a lock, for "not acquired" messages: `held by "w-1" (fence 7, for 3s,
/// 27s left)`, `held by 2 holders (limit 2): "w-1" (fence 7, …), …`, or why not
/// (a queue ahead, a lock-delay).
pub fn holders(lock: &LockInfo) -> String {
    let one = |h: &fencelock::HolderInfo| {
        format!(
            "{:?} (fence {}, for {}, {} left)",
            h.owner,
            h.fence,
            human_ms(h.held_ms),
            human_ms(h.ttl_remaining_ms)
        )
    };
    let mut text = match lock.holders.as_slice() {
        [] if lock.lock_delay_remaining_ms > 0 => format!(
            "in lock-delay for {} more",
            human_ms(lock.lock_delay_remaining_ms)
        ),
        [] => "free, but others are queued ahead".to_owned(),
        [h] => format!("held by {}", one(h)),
        many => format!(
            "held by {} holders (limit {}): {}",
            many.len(),
            lock.limit,
            many.iter().map(one).collect::<Vec<_>>().join(", ")
        ),
    };
    if lock.waiters > 0 {
        text.push_str(&format!("; {} waiting", lock.waiters));
    }
    text
}

/// The message of a lock not acquired within `wait` (`wait` zero: not at all).
pub fn not_acquired(name: &str, wait: std::time::Duration, why: &str) -> String {
    if wait.is_zero() {
        format!("not acquired: {name:?} is {why}")
    } else {
        format!(
            "not acquired within {} (--wait): {name:?} is {why}",
            crate::remote::human(wait)
        )
    }
}

/// The exit code and message of a failed admin request over HTTP (`backup`, `audit`,
/// `sessions`, `cluster`): 69 unreachable or unavailable, 77 not authenticated or not
/// allowed, 2 refused as malformed, 1 otherwise.
pub fn http_failure(e: anyhow::Error) -> Failure {
    if let Some(down) = e.downcast_ref::<Unreachable>() {
        return Failure {
            message: format!("server unreachable: {down}"),
            code: exit::UNAVAILABLE,
        };
    }
    let Some(answer) = e.downcast_ref::<HttpStatus>() else {
        return Failure {
            message: format!("{e:#}"),
            code: exit::FAILURE,
        };
    };
    let said = server_message(answer);
    let (code, message) = match answer.status {
        401 => (exit::NO_PERMISSION, unauthenticated(&said)),
        403 => (exit::NO_PERMISSION, format!("not allowed: {said}")),
        400 => (exit::USAGE, flag_message(&said)),
        503 => (exit::UNAVAILABLE, format!("server unavailable: {said}")),
        status => (exit::FAILURE, format!("server answered {status}: {said}")),
    };
    Failure { message, code }
}

/// The `message` of the server's `{"error":{…}}` body, or the body itself.
fn server_message(answer: &HttpStatus) -> String {
    serde_json::from_str::<serde_json::Value>(&answer.body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| answer.body.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_fields_become_the_flags_the_user_typed() {
        assert_eq!(
            flag_message("ttl_ms must be between 10 and 86400000, got 5"),
            "--ttl must be at least 10ms (got 5ms)"
        );
        assert_eq!(
            flag_message("wait_ms must be between 0 and 3600000, got 7200000"),
            "--wait must be at most 1h (got 2h)"
        );
        assert_eq!(
            flag_message("limit must be between 1 and 64, got 100"),
            "--limit must be at most 64 (got 100)"
        );
        assert_eq!(
            flag_message("session ttl_ms must be between 10 and 86400000, got 1"),
            "--ttl must be at least 10ms (got 1ms)"
        );
        assert_eq!(
            flag_message("name: contains a control character"),
            "the lock name: contains a control character"
        );
        assert_eq!(
            flag_message("limit must be at least 1"),
            "--limit must be at least 1"
        );
        assert_eq!(flag_message("something else"), "something else");
    }

    #[test]
    fn a_401_is_an_authentication_message_and_a_403_a_refusal() {
        for text in [
            "unknown token",
            "this call needs a token (authorization: Bearer …)",
            "expected `Authorization: Bearer <token>`",
        ] {
            let e = Error::new(ErrorKind::PermissionDenied, text);
            let said = client_error(&e);
            assert!(said.starts_with("not authenticated: "), "{said}");
            assert!(!said.contains("permission_denied"), "{said}");
        }
        let e = Error::new(
            ErrorKind::PermissionDenied,
            "\"other:a\" is outside the prefixes of token \"jobs\" ([\"job:\"])",
        );
        assert!(client_error(&e).starts_with("not allowed: "));

        let status = |status: u16, body: &str| -> anyhow::Error {
            HttpStatus {
                status,
                body: body.to_owned(),
            }
            .into()
        };
        let f = http_failure(status(
            401,
            r#"{"error":{"code":"unauthenticated","message":"unknown token"}}"#,
        ));
        assert_eq!(f.code, exit::NO_PERMISSION);
        assert!(f.message.starts_with("not authenticated: unknown token"));
        let f = http_failure(status(403, r#"{"error":{"message":"no"}}"#));
        assert_eq!(
            (f.code, f.message.as_str()),
            (exit::NO_PERMISSION, "not allowed: no")
        );
        assert_eq!(http_failure(status(400, "x")).code, exit::USAGE);
        assert_eq!(http_failure(status(503, "x")).code, exit::UNAVAILABLE);
        assert_eq!(http_failure(status(404, "x")).code, exit::FAILURE);
        let down = anyhow::Error::from(Unreachable("cannot connect".into()));
        assert_eq!(http_failure(down).code, exit::UNAVAILABLE);
    }
}
