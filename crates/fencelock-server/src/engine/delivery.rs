//! What goes out once a batch is durable, as data: the engine task queues
//! [`Delivery`] values, and whoever makes the batch durable (the writer thread after
//! its fdatasync; in cluster mode the engine task once the entries are committed)
//! runs them with [`Delivery::deliver`]. Being data, what a batch will answer, and
//! to whom, can be looked at before it goes out (and is, in the tests): only a
//! read's answer stays a closure, its value's type being the caller's.

use std::sync::Arc;

use fencelock_core::{Grant, Reply};
use tokio::sync::broadcast;

use super::history::History;
use super::queue::EngineTx;
use super::{count_event, AcquireReply, CommandReply, Msg, SharedEvent};
use crate::error::ApiError;
use crate::metrics::Metrics;

/// One answer (or batch of events) of a batch, run once the batch is durable.
pub(super) enum Delivery {
    /// A command's answer.
    Reply {
        reply: CommandReply,
        result: Result<Reply, ApiError>,
    },
    /// A grant, to every client waiting on its request (by listener id). If none
    /// takes it, it is released through `orphans` (the engine's inbox): a lock
    /// granted to a departed client must not sit until its lease ends. `None` only
    /// for a planted bug's speculative grant, which is never released that way.
    Granted {
        grant: Grant,
        listeners: Vec<(u128, AcquireReply)>,
        orphans: Option<EngineTx>,
    },
    /// A multi-lock request's grants (see `Granted`): all released if nobody
    /// takes them.
    GrantedAll {
        grants: Vec<Grant>,
        listeners: Vec<(u128, AcquireReply)>,
        orphans: Option<EngineTx>,
    },
    /// An acquire refused, or waits ended (timed out, cancelled, drained): the
    /// same error to every listener.
    Refused {
        listeners: Vec<(u128, AcquireReply)>,
        error: ApiError,
    },
    /// Watch events: counted in the metrics, kept in the history, then published
    /// (no watcher is not an error). History before publishing: a resuming watch
    /// subscribes before it reads the history, so it misses none.
    Events {
        events: Vec<SharedEvent>,
        metrics: Arc<Metrics>,
        sender: broadcast::Sender<SharedEvent>,
        history: Arc<History>,
    },
    /// A read's answer, its value already computed (`Msg::Read`).
    Read(Box<dyn FnOnce() + Send>),
}

impl Delivery {
    /// A command's answer, from the core's result.
    pub(super) fn reply(
        reply: CommandReply,
        result: Result<Reply, fencelock_core::Error>,
    ) -> Delivery {
        Delivery::Reply {
            reply,
            result: result.map_err(ApiError::from),
        }
    }

    /// An acquire's refusal, to the one client that asked.
    pub(super) fn refused(listener: u128, reply: AcquireReply, error: ApiError) -> Delivery {
        Delivery::Refused {
            listeners: vec![(listener, reply)],
            error,
        }
    }

    /// Sends it: on the writer thread after the fdatasync that covers it (a
    /// release's reply after the write), or on the engine task in cluster mode.
    /// A sink runs right here (see `GrantSink`).
    pub(super) fn deliver(self) {
        match self {
            Delivery::Reply { reply, result } => reply.send(result),
            Delivery::Granted {
                grant,
                listeners,
                orphans,
            } => {
                let mut delivered = false;
                for (_, reply) in listeners {
                    delivered |= reply.send(Ok(grant.clone()));
                }
                if let (false, Some(orphans)) = (delivered, orphans) {
                    let _ = orphans.send(Msg::ReleaseOrphan {
                        name: grant.name,
                        token: grant.token,
                    });
                }
            }
            Delivery::GrantedAll {
                grants,
                listeners,
                orphans,
            } => {
                let mut delivered = false;
                for (_, reply) in listeners {
                    delivered |= reply.send_all(Ok(grants.clone()));
                }
                if let (false, Some(orphans)) = (delivered, orphans) {
                    for grant in grants {
                        let _ = orphans.send(Msg::ReleaseOrphan {
                            name: grant.name,
                            token: grant.token,
                        });
                    }
                }
            }
            Delivery::Refused {
                mut listeners,
                error,
            } => {
                // The last listener (usually the only one) takes the error itself.
                let last = listeners.pop();
                for (_, reply) in listeners {
                    let _ = reply.send(Err(error.clone()));
                }
                if let Some((_, reply)) = last {
                    let _ = reply.send(Err(error));
                }
            }
            Delivery::Events {
                events,
                metrics,
                sender,
                history,
            } => {
                history.push_all(&events);
                for event in events {
                    count_event(&metrics, &event);
                    let _ = sender.send(event);
                }
            }
            Delivery::Read(answer) => answer(),
        }
    }
}
