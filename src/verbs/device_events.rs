//! A device's asynchronous events (`ibv_get_async_event`): a thread per device context,
//! started with the first CQ opened on it, reads them for the life of the process (rdma_cm
//! never closes its contexts). A CQ overrun, in which the device dropped completions that
//! did not fit, marks the CQ, whose reads then report `FI_EOVERRUN` once they have returned
//! what the device kept (fi_cq(3)); the other events are logged.
//!
//! rxe frees a queue slot when its work completes, not when its completion is read, so an
//! application that keeps posting without reading can overrun a CQ however it was sized:
//! the device's event is the only trace of what it dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rfabric_sys::verbs::{AsyncEvent, Context};

use super::cq::CompletionQueue;

/// The CQs of one device context, by `Cq::id`.
#[derive(Default)]
struct Watched {
    cqs: Mutex<HashMap<usize, Weak<CompletionQueue>>>,
}

/// The watched contexts, by `Context::id`; each entry's thread runs as long as the process.
fn watchers() -> &'static Mutex<HashMap<usize, Arc<Watched>>> {
    static W: OnceLock<Mutex<HashMap<usize, Arc<Watched>>>> = OnceLock::new();
    W.get_or_init(Mutex::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reports the overruns of CQ `id` on `ctx` to `cq` from now on (the thread starts with the
/// context's first CQ). A thread that cannot start leaves overruns unreported, as it logs.
pub(crate) fn watch_cq(ctx: Context, id: usize, cq: Weak<CompletionQueue>) {
    let w = {
        let mut all = lock(watchers());
        if let Some(w) = all.get(&ctx.id()) {
            w.clone()
        } else {
            let w = Arc::new(Watched::default());
            let t = w.clone();
            let spawned = std::thread::Builder::new()
                .name("rverbs-events".into())
                .spawn(move || read_events(ctx, &t));
            if let Err(e) = spawned {
                crate::fi_warn!(
                    "cq",
                    "device events are not watched ({e}): a CQ overrun will go unreported"
                );
                return;
            }
            all.insert(ctx.id(), w.clone());
            w
        }
    };
    lock(&w.cqs).insert(id, cq);
}

/// Forgets CQ `id` on `ctx`: called before it is destroyed, so an event read meanwhile (its
/// destroy waits for the acknowledgement) finds nothing, and a CQ made later at the same
/// address is never taken for it.
pub(crate) fn forget_cq(ctx: Context, id: usize) {
    let w = lock(watchers()).get(&ctx.id()).cloned();
    if let Some(w) = w {
        lock(&w.cqs).remove(&id);
    }
}

fn read_events(ctx: Context, w: &Watched) {
    loop {
        // The CQ is handed out of the event's scope: were it the last reference, its destroy
        // would wait for this event's acknowledgement, in this thread.
        let r = ctx.read_async_event(|e| match e {
            AsyncEvent::CqError(id) => {
                let cq = lock(&w.cqs).get(&id).and_then(Weak::upgrade);
                match &cq {
                    Some(cq) => {
                        crate::fi_warn!(
                            "cq",
                            "CQ overrun: the device dropped completions that did not fit (read the CQ as fast as operations complete)"
                        );
                        cq.device_overran();
                    }
                    None => crate::fi_info!("cq", "an overrun of a CQ being closed"),
                }
                cq
            }
            AsyncEvent::Qp { qp_num, what } => {
                crate::fi_info!("ep", "device event: {what} on QP {qp_num:#x}");
                None
            }
            AsyncEvent::Other(what) => {
                crate::fi_info!("domain", "device event: {what}");
                None
            }
        });
        match r {
            Ok(cq) => drop(cq),
            // A signal (the application's, or a debugger's) ended the wait: wait again.
            Err(e) if e == nix::errno::Errno::EINTR as i32 => {}
            Err(e) => {
                crate::fi_warn!(
                    "domain",
                    "reading device events stopped ({}): a CQ overrun will go unreported",
                    crate::core::error::strerror(e)
                );
                return;
            }
        }
    }
}
