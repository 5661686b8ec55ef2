//! Typed replies: each command has one reply shape (an acquire is granted or
//! queued, a renew gives a grant, a release says whether it released, …). These
//! helpers take the core's [`Reply`] apart into that shape, so no caller matches
//! on replies its command cannot produce. A reply of another shape would be a bug
//! in the core; it is answered as `internal` and logged, never a panic on a
//! request path.

use fencelock_core::{Fence, Grant, OwnerToken, Reply, SessionId};

use crate::error::{ApiError, ApiErrorKind};

/// What an acquire answers.
#[derive(Debug)]
pub(crate) enum Acquired {
    /// Granted now.
    Granted(Grant),
    /// A multi-lock request, granted now (in the order asked).
    GrantedAll(Vec<Grant>),
    /// Queued: the grant (or the end of the wait) follows as an outcome for `token`.
    Queued(OwnerToken),
}

/// An acquire's reply.
pub(crate) fn acquired(reply: Reply) -> Result<Acquired, ApiError> {
    match reply {
        Reply::Granted(grant) => Ok(Acquired::Granted(grant)),
        Reply::Queued { token, .. } => Ok(Acquired::Queued(token)),
        Reply::GrantedAll(grants) if !grants.is_empty() => Ok(Acquired::GrantedAll(grants)),
        // A multi-lock request's client listens on its first part.
        Reply::QueuedAll { tokens } if !tokens.is_empty() => Ok(Acquired::Queued(tokens[0])),
        other => Err(mismatch("an acquire", &other)),
    }
}

/// A renew's reply: the extended grant.
pub(crate) fn renewed(reply: Reply) -> Result<Grant, ApiError> {
    match reply {
        Reply::Renewed(grant) => Ok(grant),
        other => Err(mismatch("a renew", &other)),
    }
}

/// A release's reply: `false` if this token had released it already.
pub(crate) fn released(reply: Reply) -> Result<bool, ApiError> {
    match reply {
        Reply::Released { released } => Ok(released),
        other => Err(mismatch("a release", &other)),
    }
}

/// A downgrade's reply: the grant, now shared.
pub(crate) fn downgraded(reply: Reply) -> Result<Grant, ApiError> {
    match reply {
        Reply::Downgraded { grant, .. } => Ok(grant),
        other => Err(mismatch("a downgrade", &other)),
    }
}

/// A proclaim's reply: the leader's grant.
pub(crate) fn proclaimed(reply: Reply) -> Result<Grant, ApiError> {
    match reply {
        Reply::Proclaimed(grant) => Ok(grant),
        other => Err(mismatch("a proclaim", &other)),
    }
}

/// A release-all's reply: per grant, whether this command released it.
pub(crate) fn released_all(reply: Reply) -> Result<Vec<bool>, ApiError> {
    match reply {
        Reply::ReleasedAll { released } => Ok(released),
        other => Err(mismatch("a release of several grants", &other)),
    }
}

/// A forced release's reply: the fences taken.
pub(crate) fn force_released(reply: Reply) -> Result<Vec<Fence>, ApiError> {
    match reply {
        Reply::ForceReleased { fences } => Ok(fences),
        other => Err(mismatch("a forced release", &other)),
    }
}

/// An open session's reply: its id and ttl.
pub(crate) fn session_opened(reply: Reply) -> Result<(SessionId, u64), ApiError> {
    match reply {
        Reply::SessionOpened { id, ttl_ms } => Ok((id, ttl_ms)),
        other => Err(mismatch("an open session", &other)),
    }
}

/// A keep-alive's reply: the session's ttl.
pub(crate) fn kept_alive(reply: Reply) -> Result<u64, ApiError> {
    match reply {
        Reply::KeptAlive { ttl_ms } => Ok(ttl_ms),
        other => Err(mismatch("a keep-alive", &other)),
    }
}

/// A close session's reply: how many locks it released.
pub(crate) fn session_closed(reply: Reply) -> Result<usize, ApiError> {
    match reply {
        Reply::SessionClosed { released } => Ok(released),
        other => Err(mismatch("a close session", &other)),
    }
}

fn mismatch(command: &str, reply: &Reply) -> ApiError {
    tracing::error!(
        ?reply,
        "the core answered {command} with a reply of another command"
    );
    ApiError::new(
        ApiErrorKind::Internal,
        format!("the server answered {command} with {reply:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply of another command is an internal error, not a panic.
    #[test]
    fn a_reply_of_another_shape_is_internal() {
        let e = renewed(Reply::Ticked).unwrap_err();
        assert_eq!(e.kind(), ApiErrorKind::Internal);
        assert!(e.message().contains("a renew"), "{e}");
        assert!(matches!(
            released(Reply::Released { released: true }),
            Ok(true)
        ));
        assert!(matches!(
            acquired(Reply::Released { released: true }),
            Err(e) if e.kind() == ApiErrorKind::Internal
        ));
    }
}
