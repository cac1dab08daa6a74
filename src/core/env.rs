//! The `FI_RVERBS_*` knobs: one table, read by the provider, `rfab_info --env` and the README.

use crate::core::error::{errno, Error, Result};

/// A documented environment variable.
#[derive(Debug)]
pub struct Knob {
    pub name: &'static str,
    pub default: &'static str,
    pub help: &'static str,
}

/// Every knob rfabric reads.
pub const KNOBS: &[Knob] = &[
    Knob {
        name: "FI_LOG_LEVEL",
        default: "(unset: silent)",
        help: "warn, trace, info or debug: what the provider explains on stderr",
    },
    Knob {
        name: "FI_RVERBS_TX_SIZE",
        default: "384",
        help: "default send queue depth of an endpoint when hints leave it 0",
    },
    Knob {
        name: "FI_RVERBS_RX_SIZE",
        default: "384",
        help: "default receive queue depth of an endpoint when hints leave it 0",
    },
    Knob {
        name: "FI_RVERBS_CQ_SIZE",
        default: "2048",
        help: "default completion queue size when fi_cq_attr.size is 0",
    },
    Knob {
        name: "FI_RVERBS_INLINE_SIZE",
        default: "(device: max_sge x 16)",
        help: "largest send carried inline in the work request (inject_size)",
    },
    Knob {
        name: "FI_RVERBS_MIN_RNR_TIMER",
        default: "12 (0.64 ms)",
        help: "IB code (0-31) of the receiver-not-ready delay an RC endpoint asks senders to wait",
    },
    Knob {
        name: "FI_RVERBS_RETRY_COUNT",
        default: "7",
        help: "transport retries (0-7) before a send to a silent peer fails with FI_ETIMEDOUT (rxe: 7 retries forever)",
    },
    Knob {
        name: "FI_RVERBS_CM_TIMEOUT_MS",
        default: "2000",
        help: "address and route resolution timeout of rdma_cm",
    },
    Knob {
        name: "FI_RVERBS_RDM_BUFFER_SIZE",
        default: "16384",
        help: "bytes of each RDM bounce buffer (256-1048576); an eager message is this less its 32-byte header, or the whole buffer when it goes without one; larger ones go in segments, then by rendezvous",
    },
    Knob {
        name: "FI_RVERBS_RDM_RX_HEAD",
        default: "256",
        help: "bytes at the start of each RDM receive bounce buffer kept in a compact area (16 buffers' heads to a 4 KiB page), the rest of the buffer being a second element of its SRQ receive; 0 (or a device with one element per SRQ receive): each buffer in one piece",
    },
    Knob {
        name: "FI_RVERBS_RDM_CONNECT_RETRY_MS",
        default: "2000",
        help: "how long an RDM endpoint tries again a connect that was refused (nobody listening at the peer's address yet), 10 ms apart doubling to 200 ms, before the sends waiting for it fail; 0: at the first refusal",
    },
    Knob {
        name: "FI_RVERBS_RDM_SHM",
        default: "1",
        help: "1: an RDM endpoint reaches peers on its own host through libfabric's shm, imported inside it at fi_enable (every message size); 0: every peer over verbs",
    },
    Knob {
        name: "FI_RVERBS_RDM_SEGMENTED_MAX",
        default: "65536 (at most 64 buffers)",
        help: "largest RDM message sent in segments (several bounce buffers, copied on both sides, no registration); larger ones go by rendezvous (RDMA read); at most 64 bounce buffers' worth, 0 for none",
    },
    Knob {
        name: "FI_RVERBS_MR_CACHE_MAX_COUNT",
        default: "1024",
        help: "registrations an RDM domain's registration cache keeps (C buffers of rendezvous, watched by a userfaultfd memory monitor); 0 turns the cache off",
    },
    Knob {
        name: "FI_RVERBS_MR_CACHE_MAX_SIZE",
        default: "(half the memory per online CPU)",
        help: "bytes the registration cache may pin; a larger registration is made for its operation only; 0 turns the cache off",
    },
];

/// Reads a numeric knob; a malformed value is an error naming the variable, not a silent default.
pub fn get_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::new(
                errno::EINVAL,
                format!("{name}={v:?} is not a number: unset it or give a non-negative integer"),
            )
        }),
        Err(_) => Ok(None),
    }
}

/// A numeric knob with its documented default.
pub fn get_usize_or(name: &str, default: usize) -> Result<usize> {
    Ok(get_usize(name)?.unwrap_or(default))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_knob_is_named_in_libfabric_form() {
        for k in KNOBS {
            assert!(
                k.name == "FI_LOG_LEVEL"
                    || k.name.starts_with("FI_RVERBS_")
                    || k.name.starts_with("FI_RSHM_"),
                "{}",
                k.name
            );
            assert!(!k.help.is_empty() && !k.default.is_empty());
        }
    }

    /// Every knob the sources read is in the table (so `rfab_info --env` lists it) and in the
    /// README's table of knobs.
    #[test]
    fn every_knob_the_sources_name_is_listed_and_documented() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
        let mut dirs = vec![root.join("src")];
        let mut names = std::collections::BTreeSet::new();
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for (i, _) in text.match_indices("FI_RVERBS_") {
                    let n: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    // `FI_RVERBS_*` in prose names the family, not a knob.
                    if !n.ends_with('_') {
                        names.insert(n);
                    }
                }
            }
        }
        // Not knobs: the C extension interface's name, and this module's test variable.
        names.remove("FI_RVERBS_PEER_OPS");
        names.remove("FI_RVERBS_TEST_KNOB");
        assert!(names.len() >= 10, "{names:?}");
        for n in &names {
            assert!(KNOBS.iter().any(|k| k.name == n), "{n} is not in KNOBS");
            assert!(
                readme.contains(&format!("| `{n}` |")),
                "{n} is not in the README's knob table"
            );
        }
    }

    #[test]
    fn malformed_numbers_are_rejected_with_the_variable_named() {
        std::env::set_var("FI_RVERBS_TEST_KNOB", "lots");
        let e = get_usize("FI_RVERBS_TEST_KNOB").unwrap_err();
        assert_eq!(e.errno(), errno::EINVAL);
        assert!(e.cause().contains("FI_RVERBS_TEST_KNOB"));
        std::env::set_var("FI_RVERBS_TEST_KNOB", "64");
        assert_eq!(get_usize_or("FI_RVERBS_TEST_KNOB", 1).unwrap(), 64);
        std::env::remove_var("FI_RVERBS_TEST_KNOB");
        assert_eq!(get_usize_or("FI_RVERBS_TEST_KNOB", 7).unwrap(), 7);
    }
}
