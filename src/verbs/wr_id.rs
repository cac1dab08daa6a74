//! What a work request id carries besides the application's context.
//!
//! Contexts are pointers in C, and user-space pointers never use the top byte (even with
//! 5-level paging they stay below 2^56), so that byte carries the operation's kind — the
//! flags of its error entry, since verbs leaves a failed completion's opcode undefined —
//! and whether its successful completion is suppressed.

use crate::core::error::{errno, Error, Result};
use crate::core::flags::Flags;

/// The bits of a work request id that are the application's context.
pub(crate) const CONTEXT: u64 = (1 << 56) - 1;
/// A work request whose success nobody asked to see: a send signalled only to free the
/// send queue, or a receive under selective completion. Its failure is still reported.
pub(crate) const SUPPRESSED: u64 = 1 << 63;
/// A transfer a peer provider posted through the endpoint (fi_peer(3) `FI_PEER_TRANSFER`):
/// its completion goes to the peer's callbacks, never to the application's CQ.
pub(crate) const PEER: u64 = 1 << 62;
const KIND_SHIFT: u32 = 56;
/// The bits of a work request id that are not the context: kind and marks.
pub(crate) const KIND_BITS: u64 = !CONTEXT;
const KIND_MASK: u64 = 0x3f;

/// The kinds of operation an error entry can name. Those the CQ translates alone come
/// first, so that one comparison tells them (`is_plain`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Send = 1,
    SendData = 2,
    Recv = 3,
    /// Posted by `shutdown` behind everything else; its flush says the queue is empty.
    Marker = 4,
    /// An RDMA write (`fi_write`, with or without remote CQ data).
    Write = 5,
    /// An RDMA read (`fi_read`).
    Read = 6,
    /// The posted part of an `FI_MULTI_RECV` buffer; the context names its endpoint.
    MultiRecv = 7,
    /// A datagram receive: its endpoint reports the length (without a provider GRH slot)
    /// and the source.
    DgramRecv = 8,
    /// A datagram receive smaller than the MTU, with a provider overflow element behind it
    /// so that a longer datagram is reported truncated (with `olen`) instead of lost.
    DgramShort = 9,
    /// An RDM endpoint's bounce buffer on its SRQ; the context is the buffer's index.
    RdmRecv = 10,
    /// An RDM endpoint's send from a bounce buffer; the context is the buffer's index.
    RdmSend = 11,
    /// An RDM endpoint's rendezvous read; the context is the read's index.
    RdmRead = 12,
    /// A datagram receive the CQ reports itself: the whole MTU after the provider's GRH
    /// slot, no source to find (the endpoint's only UD receives on its CQ, `claim_plain_ud`).
    DgramPlain = 13,
}

/// The last of the kinds the CQ translates alone.
const LAST_PLAIN: u64 = Kind::Read as u64;

/// The kind of a send: with remote CQ data (immediate data) or without.
#[inline(always)]
pub(crate) fn send_kind(imm: Option<u32>) -> Kind {
    if imm.is_some() {
        Kind::SendData
    } else {
        Kind::Send
    }
}

/// Rejects contexts that use the reserved top byte instead of corrupting them.
#[inline]
pub(crate) fn check(context: u64) -> Result<()> {
    if context & !CONTEXT != 0 {
        return Err(Error::new(
            errno::EINVAL,
            "operation contexts must be below 2^56 (the top byte is reserved)",
        ));
    }
    Ok(())
}

#[inline(always)]
pub(crate) fn encode(context: u64, kind: Kind, suppressed: bool) -> u64 {
    context | ((kind as u64) << KIND_SHIFT) | if suppressed { SUPPRESSED } else { 0 }
}

#[inline(always)]
pub(crate) fn context(wr_id: u64) -> u64 {
    wr_id & CONTEXT
}

#[inline(always)]
pub(crate) fn is_peer(wr_id: u64) -> bool {
    wr_id & PEER != 0
}

#[inline(always)]
pub(crate) fn is_suppressed(wr_id: u64) -> bool {
    wr_id & SUPPRESSED != 0
}

#[inline(always)]
pub(crate) fn is_marker(wr_id: u64) -> bool {
    (wr_id >> KIND_SHIFT) & KIND_MASK == Kind::Marker as u64
}

/// Whether the endpoint, not the CQ, makes the entry of this work request's completion.
#[inline(always)]
pub(crate) fn is_owned(wr_id: u64) -> bool {
    let k = (wr_id >> KIND_SHIFT) & KIND_MASK;
    k == Kind::MultiRecv as u64
        || k == Kind::DgramRecv as u64
        || k == Kind::DgramShort as u64
        || k == Kind::RdmRecv as u64
        || k == Kind::RdmSend as u64
        || k == Kind::RdmRead as u64
}

/// Whether a successful completion is reported as the CQ translates it (`to_entry`): a
/// kind up to `LAST_PLAIN` (or none), not suppressed, not a peer's: one comparison of the
/// top byte, whose marks make it larger.
#[inline(always)]
pub(crate) fn is_plain(wr_id: u64) -> bool {
    wr_id >> KIND_SHIFT <= LAST_PLAIN
}

/// Whether the work request is of `kind`, neither suppressed nor a peer's.
#[inline(always)]
pub(crate) fn is_bare(wr_id: u64, kind: Kind) -> bool {
    wr_id >> KIND_SHIFT == kind as u64
}

/// Bits of a keyed work request id that index the owner's operation (`keyed`).
pub(crate) const INDEX_BITS: u32 = 24;

/// A work request id of an owner found by key (an RDM endpoint's): `index` names the
/// operation (below 2^24), `key` the owner (`CompletionQueue::register_keyed_owner`).
#[inline(always)]
pub(crate) fn keyed(index: u32, key: u32, kind: Kind) -> u64 {
    debug_assert!(index < 1 << INDEX_BITS);
    encode(
        u64::from(index) | (u64::from(key) << INDEX_BITS),
        kind,
        false,
    )
}

/// The operation index of a keyed work request id.
#[inline(always)]
pub(crate) fn index(wr_id: u64) -> u32 {
    (wr_id & ((1 << INDEX_BITS) - 1)) as u32
}

/// The owner key of an RDM work request id, `None` for other kinds.
#[inline(always)]
pub(crate) fn owner_key(wr_id: u64) -> Option<u32> {
    let k = (wr_id >> KIND_SHIFT) & KIND_MASK;
    (k == Kind::RdmRecv as u64 || k == Kind::RdmSend as u64 || k == Kind::RdmRead as u64)
        .then_some(((wr_id & CONTEXT) >> INDEX_BITS) as u32)
}

#[inline(always)]
pub(crate) fn is_kind(wr_id: u64, kind: Kind) -> bool {
    (wr_id >> KIND_SHIFT) & KIND_MASK == kind as u64
}

/// Completion flags of the operation, for its error entry.
pub(crate) fn flags(wr_id: u64) -> Flags {
    match (wr_id >> KIND_SHIFT) & KIND_MASK {
        k if k == Kind::Send as u64 => Flags::MSG | Flags::SEND,
        k if k == Kind::SendData as u64 => Flags::MSG | Flags::SEND | Flags::REMOTE_CQ_DATA,
        k if k == Kind::Recv as u64 => Flags::MSG | Flags::RECV,
        k if k == Kind::Write as u64 => Flags::RMA | Flags::WRITE,
        k if k == Kind::Read as u64 => Flags::RMA | Flags::READ,
        k if k == Kind::MultiRecv as u64 => Flags::MSG | Flags::RECV | Flags::MULTI_RECV,
        k if k == Kind::DgramRecv as u64
            || k == Kind::DgramShort as u64
            || k == Kind::DgramPlain as u64 =>
        {
            Flags::MSG | Flags::RECV
        }
        _ => Flags::empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_kind_and_suppression_round_trip() {
        let ctx = 0x00ff_ffff_ffff_fff8;
        for (kind, f) in [
            (Kind::Send, Flags::MSG | Flags::SEND),
            (
                Kind::SendData,
                Flags::MSG | Flags::SEND | Flags::REMOTE_CQ_DATA,
            ),
            (Kind::Recv, Flags::MSG | Flags::RECV),
            (Kind::Write, Flags::RMA | Flags::WRITE),
            (Kind::Read, Flags::RMA | Flags::READ),
        ] {
            for sup in [false, true] {
                let w = encode(ctx, kind, sup);
                assert_eq!((context(w), flags(w), is_suppressed(w)), (ctx, f, sup));
            }
        }
    }

    #[test]
    fn keyed_ids_carry_index_key_and_kind() {
        for kind in [Kind::RdmRecv, Kind::RdmSend, Kind::RdmRead] {
            let w = keyed(0xff_fffe, u32::MAX, kind);
            assert_eq!((index(w), owner_key(w)), (0xff_fffe, Some(u32::MAX)));
            assert!(is_owned(w) && is_kind(w, kind) && !is_suppressed(w) && !is_peer(w));
        }
        assert_eq!(owner_key(encode(7 << INDEX_BITS, Kind::Recv, false)), None);
        assert_eq!(
            owner_key(encode(7 << INDEX_BITS, Kind::DgramRecv, false)),
            None
        );
    }

    #[test]
    fn contexts_in_the_reserved_byte_are_refused() {
        assert!(check(CONTEXT).is_ok());
        assert_eq!(check(1 << 56).unwrap_err().errno(), errno::EINVAL);
        assert_eq!(check(1 << 63).unwrap_err().errno(), errno::EINVAL);
    }
}
