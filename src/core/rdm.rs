//! Reliable connectionless (`FI_EP_RDM`) protocol state, with no I/O: the endpoint name,
//! the wire header in front of eager data, and each peer's link (an RC connection made on
//! first use, with simultaneous connects resolved by name order). The verbs RDM endpoint
//! drives these and only moves bytes.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::core::error::{errno, Error, Result};

/// The name of an RDM endpoint (`fi_getname`), 40 bytes: what a peer needs to connect (the
/// listener's IP address and port) and to tell whether it is on this host (the host id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RdmName {
    /// The listener's address; IPv4 as an IPv4-mapped IPv6 address.
    pub ip: [u8; 16],
    pub port: u16,
    /// Same value for every endpoint of one host (from its boot id).
    pub host: u64,
    /// Tells apart endpoints that reuse a listener's port over time.
    pub nonce: u32,
    /// The endpoint counts RMA that targets it (`FI_RMA_EVENT`): an initiator follows each
    /// write and read with a notice.
    pub rma_event: bool,
}

const NAME_MAGIC: [u8; 2] = *b"rD";
/// A connection request's flag (byte 3, beside `rma_event`'s bit): see
/// `RdmName::request_bytes`. `parse` ignores it.
const BY_LISTENER: u8 = 2;
/// The wire protocol's version, which a name carries: 2 since eager messages may come
/// without a header (`HeaderBase`), which an endpoint of version 1 would misread.
const NAME_VERSION: u8 = 2;

impl RdmName {
    pub const LEN: usize = 40;

    pub fn new(listener: SocketAddr, host: u64, nonce: u32) -> Self {
        let ip = match listener.ip() {
            IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
            IpAddr::V6(v) => v.octets(),
        };
        RdmName {
            ip,
            port: listener.port(),
            host,
            nonce,
            rma_event: false,
        }
    }

    /// The name of whichever endpoint listens at `at`, as `fi_getinfo` gives it for a node
    /// and a service: no host id, so a peer named by it is reached over verbs (never shm).
    pub fn listener(at: SocketAddr) -> Self {
        RdmName::new(at, 0, 0)
    }

    /// Whether this name came from a node and a service (`Self::listener`), not from the
    /// endpoint itself.
    pub fn is_listener(&self) -> bool {
        self.host == 0
    }

    /// What a connection request carries: this endpoint's name `own`, marked when it knows
    /// the peer it connects to by its listener alone (`by_listener`), so the peer answers
    /// over the same connection even when both are on one host.
    pub fn request_bytes(own: &[u8; Self::LEN], by_listener: bool) -> [u8; Self::LEN] {
        let mut b = *own;
        if by_listener {
            b[3] |= BY_LISTENER;
        }
        b
    }

    /// The mark of [`Self::request_bytes`] in a request's name.
    pub fn requested_by_listener(bytes: &[u8]) -> bool {
        bytes.len() == Self::LEN && bytes[3] & BY_LISTENER != 0
    }

    /// The bytes that order two names when both ends connect at once: the listener's port
    /// and address, which no two live endpoints share and which a name from
    /// [`Self::listener`] has too, so both sides agree on the winner.
    pub fn race_key(bytes: &[u8]) -> &[u8] {
        &bytes[4..24]
    }

    /// Where its listener waits for connections.
    pub fn sockaddr(&self) -> SocketAddr {
        let v6 = Ipv6Addr::from(self.ip);
        match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), self.port),
            None => SocketAddr::new(IpAddr::V6(v6), self.port),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..2].copy_from_slice(&NAME_MAGIC);
        b[2] = NAME_VERSION;
        b[3] = u8::from(self.rma_event);
        b[4..6].copy_from_slice(&self.port.to_be_bytes());
        b[8..24].copy_from_slice(&self.ip);
        b[24..32].copy_from_slice(&self.host.to_le_bytes());
        b[32..36].copy_from_slice(&self.nonce.to_le_bytes());
        b
    }

    pub fn parse(b: &[u8]) -> Result<Self> {
        if b.len() == Self::LEN && b[0..2] == NAME_MAGIC && b[2] != NAME_VERSION {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "an rverbs RDM endpoint name of protocol version {}, and this rverbs speaks version {NAME_VERSION}: run the same rverbs in every process of the job",
                    b[2]
                ),
            ));
        }
        if b.len() != Self::LEN || b[0..2] != NAME_MAGIC {
            return Err(Error::new(
                errno::EINVAL,
                format!(
                    "not an rverbs RDM endpoint name ({} bytes; a name is the {} bytes fi_getname gives)",
                    b.len(),
                    Self::LEN
                ),
            ));
        }
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[8..24]);
        Ok(RdmName {
            ip,
            port: u16::from_be_bytes([b[4], b[5]]),
            host: u64::from_le_bytes(b[24..32].try_into().unwrap_or_default()),
            nonce: u32::from_le_bytes(b[32..36].try_into().unwrap_or_default()),
            rma_event: b[3] & 1 != 0,
        })
    }

    /// `fi_av_straddr`'s form: `fi_rverbs_rdm://<ip>:<port>/<host>/<nonce>`.
    /// The name of this endpoint's shared-memory peer (what local peers send to): a
    /// function of the name alone, so a peer on the same host derives it at `fi_av_insert`.
    pub fn shm_name(&self) -> String {
        format!("rfab-{:016x}-{}-{:08x}", self.host, self.port, self.nonce)
    }

    pub fn to_str(&self) -> String {
        format!(
            "fi_rverbs_rdm://{}/{:#x}/{:#x}",
            self.sockaddr(),
            self.host,
            self.nonce
        )
    }
}

/// What a message carries: an eager untagged (`fi_msg`) or tagged (`fi_tagged`) message,
/// the announcement of a large one the receiver reads itself (rendezvous), or the
/// receiver's word that it has read one (its sender may complete and release it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Msg = 1,
    Tag = 2,
    /// Ready to send (rendezvous), untagged: the body is an [`Rts`].
    RtsMsg = 3,
    /// Ready to send, tagged.
    RtsTag = 4,
    /// The receiver is done reading: the body is a [`Fin`].
    Fin = 5,
    /// The first segment of a message larger than a bounce buffer sent in several
    /// (segmented protocol), untagged; [`Header::total`] is the message's size.
    SegMsg = 6,
    /// The first segment, tagged.
    SegTag = 7,
    /// A later segment: its bytes follow the segments before it on the same connection.
    Cont = 8,
    /// The remote CQ data of an RDMA write just before it on the same connection
    /// (`fi_writedata`): [`Header::data`], and the bytes written in [`Header::tag`]. RDM's
    /// 8-byte `cq_data_size` does not fit a write's 4-byte immediate.
    WriteData = 9,
    /// An RDMA read just before it on the same connection has been served (the target asked
    /// for `FI_RMA_EVENT`: it counts `FI_REMOTE_READ`). No body.
    ReadEvent = 10,
}

impl Op {
    /// The operation a header's code names.
    #[inline]
    pub fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            1 => Op::Msg,
            2 => Op::Tag,
            3 => Op::RtsMsg,
            4 => Op::RtsTag,
            5 => Op::Fin,
            6 => Op::SegMsg,
            7 => Op::SegTag,
            8 => Op::Cont,
            9 => Op::WriteData,
            10 => Op::ReadEvent,
            _ => return None,
        })
    }

    /// Whether it carries a tag that takes part in matching.
    pub fn tagged(self) -> bool {
        matches!(self, Op::Tag | Op::RtsTag | Op::SegTag)
    }
}

/// A large message announced for the receiver to read (`Op::RtsMsg`/`RtsTag` body).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rts {
    /// Where the message is in the sender's memory, and the key that lets the peer read it.
    pub addr: u64,
    pub rkey: u32,
    pub size: u64,
    /// The sender's handle on the send, echoed in the [`Fin`].
    pub id: u32,
}

impl Rts {
    pub const LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Rts> {
        if b.len() < Self::LEN {
            return Err(Error::new(
                errno::EIO,
                "malformed RDM announcement: short body",
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        Ok(Rts {
            addr: u64_at(0),
            size: u64_at(8),
            rkey: u32_at(16),
            id: u32_at(20),
        })
    }
}

/// Ranges an announcement lists at most (a send gathered from that many, `tx_attr.iov_limit`).
pub const RTS_RANGES_MAX: usize = 32;

/// One range of a message gathered from several and announced for reading (`fi_sendv` past
/// the segmented size): the announcement lists them after its [`Rts`], whose own `addr` and
/// `rkey` are then unused; the receiver reads them in order, as one message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RtsRange {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl RtsRange {
    pub const LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> RtsRange {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        RtsRange {
            addr: u64_at(0),
            len: u64_at(8),
            rkey: u32::from_le_bytes(b[16..20].try_into().unwrap_or_default()),
        }
    }
}

impl Rts {
    /// The ranges an announcement whose body is `body` bytes lists after its head: 0 when
    /// the head names the one range, else 2 to [`RTS_RANGES_MAX`].
    pub fn ranges_in(body: usize) -> Result<usize> {
        let tail = body.checked_sub(Self::LEN);
        match tail.map(|t| (t / RtsRange::LEN, t % RtsRange::LEN)) {
            Some((0, 0)) => Ok(0),
            Some((n, 0)) if (2..=RTS_RANGES_MAX).contains(&n) => Ok(n),
            _ => Err(Error::new(
                errno::EIO,
                format!("malformed RDM announcement: a {body}-byte body"),
            )),
        }
    }

    /// The ranges listed in `tail` (the bytes after the head), which must add up to the
    /// message's size.
    pub fn decode_ranges(&self, tail: &[u8]) -> Result<Box<[RtsRange]>> {
        let v: Box<[RtsRange]> = tail
            .chunks_exact(RtsRange::LEN)
            .map(RtsRange::decode)
            .collect();
        let sum = v.iter().try_fold(0u64, |s, r| s.checked_add(r.len));
        if v.len() < 2 || v.len() > RTS_RANGES_MAX || sum != Some(self.size) {
            return Err(Error::new(
                errno::EIO,
                format!(
                    "malformed RDM announcement: {} ranges of {sum:?} bytes for a {}-byte message",
                    v.len(),
                    self.size
                ),
            ));
        }
        Ok(v)
    }
}

/// One RDMA read of a rendezvous: `len` bytes at `offset` of announced range `range`,
/// landing at byte `at` of the receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub range: usize,
    pub offset: u64,
    pub at: usize,
    pub len: u32,
}

/// The reads a rendezvous takes: the first `n` bytes of the announced ranges, in order,
/// each read within one announced range, one landing range and `max` bytes (the port's
/// message size).
#[derive(Clone, Copy, Debug)]
pub struct ReadPlan {
    n: usize,
    max: u64,
    /// The next read's range and offset in it, and the bytes planned before it.
    range: usize,
    offset: u64,
    at: usize,
}

impl ReadPlan {
    pub fn new(n: usize, max: usize) -> ReadPlan {
        ReadPlan {
            n,
            max: (max as u64).clamp(1, u32::MAX as u64),
            range: 0,
            offset: 0,
            at: 0,
        }
    }

    /// Bytes planned (and, once the caller posted them, read or in flight).
    pub fn planned(&self) -> usize {
        self.at
    }

    /// The next read over `ranges`, whose landing holds `room` bytes in one piece from the
    /// next byte; `None` once all `n` bytes are planned. Ranges that end before the message
    /// are malformed (`EIO`).
    pub fn next(&self, ranges: &[RtsRange], room: usize) -> Result<Option<Piece>> {
        if self.at >= self.n {
            return Ok(None);
        }
        let (mut range, mut offset) = (self.range, self.offset);
        // The next non-empty range (a sender lists none empty, but the wire is not trusted).
        let r = loop {
            let Some(r) = ranges.get(range) else {
                return Err(Error::new(
                    errno::EIO,
                    "the announced ranges end before the message",
                ));
            };
            if offset < r.len {
                break r;
            }
            (range, offset) = (range + 1, 0);
        };
        let len = (r.len - offset)
            .min((self.n - self.at) as u64)
            .min(room as u64)
            .min(self.max);
        if len == 0 {
            return Err(Error::new(
                errno::EIO,
                "a rendezvous read past its receive buffer",
            ));
        }
        Ok(Some(Piece {
            range,
            offset,
            at: self.at,
            len: len as u32,
        }))
    }

    /// `p` (the last `next`) was posted: the plan moves past it.
    pub fn advance(&mut self, p: &Piece) {
        self.range = p.range;
        self.offset = p.offset + p.len as u64;
        self.at += p.len as usize;
    }
}

/// The end of a rendezvous (`Op::Fin` body): which send, and how it went (0, or the
/// positive libfabric errno the receiver met reading it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fin {
    pub id: u32,
    pub status: i32,
}

impl Fin {
    pub const LEN: usize = 8;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.id.to_le_bytes());
        b[4..8].copy_from_slice(&self.status.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Fin> {
        if b.len() < Self::LEN {
            return Err(Error::new(
                errno::EIO,
                "malformed RDM completion notice: short body",
            ));
        }
        Ok(Fin {
            id: u32::from_le_bytes(b[0..4].try_into().unwrap_or_default()),
            status: i32::from_le_bytes(b[4..8].try_into().unwrap_or_default()),
        })
    }
}

/// The header in front of each eager message's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    pub tag: u64,
    /// `FI_REMOTE_CQ_DATA`.
    pub data: Option<u64>,
    /// Bytes of payload behind the header.
    pub len: u32,
    /// `FI_DELIVERY_COMPLETE`: the receiver sends a [`Fin`] with this id once the message
    /// is in the receive's buffer.
    pub ack: Option<u32>,
    /// The whole message's size on a first segment (`Op::SegMsg`/`SegTag`); the key of the
    /// region written on a write's notice (`Op::WriteData`: counters bound to it count it);
    /// else 0.
    pub total: u32,
    /// A peer provider's transfer (`FI_PEER_TRANSFER`): matched against its receives only.
    pub peer: bool,
}

const HDR_MAGIC: u8 = 0xe7;
/// The short header's magic: an eager message with nothing to say but its operation,
/// flags and tag.
const HDR_MAGIC_SHORT: u8 = 0xe8;
const HAS_DATA: u8 = 1;
const HAS_ACK: u8 = 2;
const IS_PEER: u8 = 4;

impl Header {
    pub const LEN: usize = 32;
    /// The short header: magic, operation, flags, a spare byte and the tag. An eager
    /// message with no CQ data and no notice to ask for (most of them) goes with it, its
    /// length told by the bytes received: 20 fewer bytes on the wire per message, which
    /// keeps a 64-byte message below 79 (rxe computes the ICRC of shorter packets without
    /// its SIMD path, whose FPU state save is costly under emulation).
    pub const SHORT_LEN: usize = 12;

    /// The short header of this one, when it can go as one (an eager message, tagged or
    /// not, with no CQ data and no notice).
    #[inline]
    pub fn encode_short(&self) -> Option<[u8; Self::SHORT_LEN]> {
        if !matches!(self.op, Op::Msg | Op::Tag) || self.data.is_some() || self.ack.is_some() {
            return None;
        }
        let mut b = [0u8; Self::SHORT_LEN];
        b[0] = HDR_MAGIC_SHORT;
        b[1] = self.op as u8;
        b[2] = if self.peer { IS_PEER } else { 0 };
        b[4..12].copy_from_slice(&self.tag.to_le_bytes());
        Some(b)
    }

    /// A header with nothing but its operation (a notice with no tag, data or body).
    pub fn bare(op: Op) -> Header {
        Header {
            op,
            tag: 0,
            data: None,
            len: 0,
            ack: None,
            total: 0,
            peer: false,
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = HDR_MAGIC;
        b[1] = self.op as u8;
        b[2] = if self.data.is_some() { HAS_DATA } else { 0 }
            | if self.ack.is_some() { HAS_ACK } else { 0 }
            | if self.peer { IS_PEER } else { 0 };
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.data.unwrap_or(0).to_le_bytes());
        b[24..28].copy_from_slice(&self.ack.unwrap_or(0).to_le_bytes());
        b[28..32].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Reads the header of a received message of `received` bytes in all, short or full.
    #[inline]
    pub fn decode(b: &[u8], received: usize) -> Result<Header> {
        Self::decode_at(b, received).map(|(h, _)| h)
    }

    /// [`Self::decode`], with where the message's bytes begin (the header's length).
    #[inline]
    pub fn decode_at(b: &[u8], received: usize) -> Result<(Header, usize)> {
        if b.first() == Some(&HDR_MAGIC_SHORT) {
            return Self::decode_short(b, received).map(|h| (h, Self::SHORT_LEN));
        }
        Self::decode_full(b, received).map(|h| (h, Self::LEN))
    }

    #[inline]
    fn decode_short(b: &[u8], received: usize) -> Result<Header> {
        let Some(b) = b.first_chunk::<{ Self::SHORT_LEN }>() else {
            return Err(too_short(b.len()));
        };
        if received < Self::SHORT_LEN {
            return Err(too_short(received));
        }
        if received - Self::SHORT_LEN > u32::MAX as usize {
            return Err(malformed(format!("{received} bytes in one message")));
        }
        let op = match Op::from_code(b[1]) {
            Some(op @ (Op::Msg | Op::Tag)) if b[2] & !IS_PEER == 0 => op,
            _ => {
                return Err(malformed(format!(
                    "a short header with operation {} and flags {:#x}",
                    b[1], b[2]
                )))
            }
        };
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&b[4..12]);
        Ok(Header {
            op,
            tag: u64::from_le_bytes(tag),
            data: None,
            len: (received - Self::SHORT_LEN) as u32,
            ack: None,
            total: 0,
            peer: b[2] & IS_PEER != 0,
        })
    }

    #[inline]
    fn decode_full(b: &[u8], received: usize) -> Result<Header> {
        let Some(b) = b.first_chunk::<{ Self::LEN }>() else {
            return Err(too_short(b.len()));
        };
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        // Magic, operation, flags, a spare byte and the length: one load, one test for
        // the common case.
        let w0 = word(0);
        let (magic, code, bits, len) = (
            w0 as u8,
            (w0 >> 8) as u8,
            (w0 >> 16) as u8,
            (w0 >> 32) as u32,
        );
        if magic != HDR_MAGIC || received < Self::LEN || len as usize != received - Self::LEN {
            return Err(Self::bad_head(magic, len, received));
        }
        let op = Op::from_code(code).ok_or_else(|| malformed(format!("operation {code}")))?;
        let w3 = word(24);
        let total = match op {
            Op::SegMsg | Op::SegTag => {
                let t = (w3 >> 32) as u32;
                if t <= len {
                    return Err(malformed(format!(
                        "a first segment of {len} bytes of a {t}-byte message"
                    )));
                }
                t
            }
            Op::WriteData => (w3 >> 32) as u32,
            _ => 0,
        };
        Ok(Header {
            total,
            op,
            tag: word(8),
            data: (bits & HAS_DATA != 0).then(|| word(16)),
            len,
            ack: (bits & HAS_ACK != 0).then_some(w3 as u32),
            peer: bits & IS_PEER != 0,
        })
    }

    /// Why a header's first word is wrong (kept out of the path of every message).
    #[cold]
    #[inline(never)]
    fn bad_head(magic: u8, len: u32, received: usize) -> Error {
        if received < Self::LEN {
            too_short(received)
        } else if magic != HDR_MAGIC {
            malformed(format!("header magic {magic:#x}"))
        } else {
            malformed(format!(
                "header says {len} bytes, {} arrived",
                received - Self::LEN
            ))
        }
    }

    /// Whether this header's values become its connection's [`HeaderBase`]: an eager
    /// message or a segmented one's first segment (tagged or not) of the application's with
    /// no notice to ask for (so a peer that only sends whole buffers goes bare too). Both sides
    /// decide it from the header alone, so they follow the same messages.
    #[inline]
    pub fn sets_base(&self) -> bool {
        matches!(self.op, Op::Msg | Op::Tag | Op::SegMsg | Op::SegTag)
            && !self.peer
            && self.ack.is_none()
    }
}

/// Tag bits an immediate carries; the ones above come from the connection's base.
const IMM_TAG_BITS: u32 = 29;
const IMM_TAG_MASK: u64 = (1 << IMM_TAG_BITS) - 1;
const IMM_TAGGED: u32 = 1 << 30;
const IMM_DATA: u32 = 1 << 29;
/// Set in no immediate this version sends: one that has it is malformed.
const IMM_RESERVED: u32 = 1 << 31;

/// What one direction of a connection last said in a header that [`Header::sets_base`]:
/// its tag's high bits and its CQ data. A later eager message whose tag has the same high
/// bits and whose data (if any) is the same goes with no header at all: its operation,
/// flags and low tag bits in the send's 32-bit immediate, its length told by the bytes
/// received. A 1024-byte message then fills one 1024-byte MTU packet instead of two, and
/// MPI's messages (whose CQ data is the sender's rank) lose their 32-byte header. The
/// sender keeps one per connection and the receiver one per queue pair; RC delivers in
/// order and the CQ is read in order, so both see the same headers in the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderBase {
    /// `tag >> IMM_TAG_BITS` of the last tagged header (`u64::MAX`: none yet).
    hi: u64,
    data: Option<u64>,
}

impl Default for HeaderBase {
    fn default() -> Self {
        HeaderBase {
            hi: u64::MAX,
            data: None,
        }
    }
}

impl HeaderBase {
    /// The immediate standing for an eager message (`tagged`, `tag`, `data`) when this
    /// base lets it go without its header.
    #[inline(always)]
    pub fn imm(&self, tagged: bool, tag: u64, data: Option<u64>) -> Option<u32> {
        let tag_ok = if tagged {
            tag >> IMM_TAG_BITS == self.hi
        } else {
            tag == 0
        };
        let data_ok = data.is_none() || data == self.data;
        (tag_ok && data_ok).then(|| {
            (tag & IMM_TAG_MASK) as u32
                | if tagged { IMM_TAGGED } else { 0 }
                | if data.is_some() { IMM_DATA } else { 0 }
        })
    }

    /// A header that [`Header::sets_base`] went (sender) or came (receiver) this way.
    #[inline]
    pub fn note(&mut self, h: &Header) {
        if matches!(h.op, Op::Tag | Op::SegTag) {
            self.hi = h.tag >> IMM_TAG_BITS;
        }
        if h.data.is_some() {
            self.data = h.data;
        }
    }

    /// The header of a message of `received` bytes that came with `imm` and no header;
    /// `None` when this base cannot explain it (see [`Self::unexplained`]).
    #[inline]
    pub fn expand(&self, imm: u32, received: usize) -> Option<Header> {
        let tagged = imm & IMM_TAGGED != 0;
        let has_data = imm & IMM_DATA != 0;
        if imm & IMM_RESERVED != 0
            || (tagged && self.hi == u64::MAX)
            || (has_data && self.data.is_none())
            || received > u32::MAX as usize
        {
            return None;
        }
        let low = u64::from(imm) & IMM_TAG_MASK;
        Some(Header {
            op: if tagged { Op::Tag } else { Op::Msg },
            tag: if tagged {
                self.hi << IMM_TAG_BITS | low
            } else {
                low
            },
            data: if has_data { self.data } else { None },
            len: received as u32,
            ack: None,
            total: 0,
            peer: false,
        })
    }

    /// Why [`Self::expand`] refused a message.
    #[cold]
    pub fn unexplained(imm: u32, received: usize) -> Error {
        malformed(format!(
            "a {received}-byte message without a header, immediate {imm:#x}, which its connection's earlier headers do not explain"
        ))
    }
}

/// An `EIO` for a message that does not parse.
#[cold]
fn malformed(why: String) -> Error {
    Error::new(errno::EIO, format!("malformed RDM message: {why}"))
}

/// A message of `n` bytes, too short for its header.
#[cold]
fn too_short(n: usize) -> Error {
    malformed(format!("{n} bytes, shorter than its header"))
}

/// A peer's link: no connection, one being made, or one carrying its traffic. `C` names a
/// connection (the transport's token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link<C> {
    Idle,
    /// Our connect is under way; sends wait.
    Connecting(C),
    /// The peer's connect, accepted while ours was under way (or instead of one); sends wait.
    Accepting(C),
    Connected(C),
}

/// What to do with a send to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendPath<C> {
    /// Post it on this connection.
    Post(C),
    /// Queue it behind the connection under way.
    Wait,
    /// Queue it and start connecting (then call [`PeerLink::connecting`]).
    Connect,
}

/// The answer to a peer's connection request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    Accept,
    /// Our own connect wins (the lower name's connection is kept); the peer accepts ours.
    Reject,
}

/// A first-in first-out queue of at most `N` entries in a fixed array (`N` a power of two):
/// a connection's unsignalled sends, pushed and popped once per message with no growth
/// check and no allocation.
#[derive(Debug, Clone)]
pub struct FixedRing<T, const N: usize> {
    items: [T; N],
    head: u32,
    len: u32,
}

impl<T: Copy + Default, const N: usize> Default for FixedRing<T, N> {
    fn default() -> Self {
        const { assert!(N.is_power_of_two() && N <= u32::MAX as usize) };
        FixedRing {
            items: [T::default(); N],
            head: 0,
            len: 0,
        }
    }
}

impl<T: Copy + Default, const N: usize> FixedRing<T, N> {
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `v`; `false` (and nothing stored) when the ring is full.
    #[inline(always)]
    pub fn push_back(&mut self, v: T) -> bool {
        if self.len as usize == N {
            return false;
        }
        self.items[(self.head + self.len) as usize & (N - 1)] = v;
        self.len += 1;
        true
    }

    #[inline(always)]
    pub fn front(&self) -> Option<T> {
        (self.len > 0).then(|| self.items[self.head as usize & (N - 1)])
    }

    #[inline(always)]
    pub fn pop_front(&mut self) -> Option<T> {
        let v = self.front()?;
        self.head = self.head.wrapping_add(1) & (N as u32 - 1);
        self.len -= 1;
        Some(v)
    }
}

/// One peer's connection state, made on first use from either side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink<C> {
    pub link: Link<C>,
    /// Our connect that lost a simultaneous race: its rejection is expected, not an error.
    pub superseded: Option<C>,
}

impl<C: Copy + PartialEq> Default for PeerLink<C> {
    fn default() -> Self {
        PeerLink {
            link: Link::Idle,
            superseded: None,
        }
    }
}

impl<C: Copy + PartialEq> PeerLink<C> {
    pub fn send_path(&self) -> SendPath<C> {
        match self.link {
            Link::Connected(c) => SendPath::Post(c),
            Link::Connecting(_) | Link::Accepting(_) => SendPath::Wait,
            Link::Idle => SendPath::Connect,
        }
    }

    /// Our connect `c` started.
    pub fn connecting(&mut self, c: C) {
        self.link = Link::Connecting(c);
    }

    /// A connection request from the peer named `remote`, to us named `local`. When both
    /// connect at once, the connection the lower name opened is kept on both sides.
    pub fn request(&self, local: &[u8], remote: &[u8]) -> Request {
        match self.link {
            Link::Idle => Request::Accept,
            Link::Connecting(_) if race_order(remote, local).is_lt() => Request::Accept,
            // Ours wins, or a connection is already up or being accepted: a request now is
            // a duplicate (the peer's stale retry), refused.
            _ => Request::Reject,
        }
    }

    /// We accepted the peer's request as connection `c`; an own connect under way is
    /// superseded.
    pub fn accepting(&mut self, c: C) {
        if let Link::Connecting(own) = self.link {
            self.superseded = Some(own);
        }
        self.link = Link::Accepting(c);
    }

    /// Connection `c` is established; true when it carries this peer's traffic from now on
    /// (the waiting sends go there).
    pub fn established(&mut self, c: C) -> bool {
        match self.link {
            Link::Connecting(x) | Link::Accepting(x) if x == c => {
                self.link = Link::Connected(c);
                true
            }
            _ => false,
        }
    }

    /// Connection `c` failed to connect (refused or unreachable); true when the waiting
    /// sends fail with it, false when it was superseded or unknown.
    pub fn failed(&mut self, c: C) -> bool {
        if self.superseded == Some(c) {
            self.superseded = None;
            return false;
        }
        match self.link {
            Link::Connecting(x) | Link::Accepting(x) if x == c => {
                self.link = Link::Idle;
                true
            }
            _ => false,
        }
    }

    /// Connection `c` went down (the peer disconnected or closed); the next send connects
    /// again. True when it was the peer's link.
    pub fn disconnected(&mut self, c: C) -> bool {
        if self.superseded == Some(c) {
            self.superseded = None;
        }
        match self.link {
            Link::Connected(x) | Link::Connecting(x) | Link::Accepting(x) if x == c => {
                self.link = Link::Idle;
                true
            }
            _ => false,
        }
    }
}

/// How two names order in a connect race: by listener address (`RdmName::race_key`),
/// then whole, for names that are not RDM names' bytes (the engine's own tests).
fn race_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    if a.len() == RdmName::LEN && b.len() == RdmName::LEN {
        let o = RdmName::race_key(a).cmp(RdmName::race_key(b));
        if o.is_ne() {
            return o;
        }
    }
    a.cmp(b)
}

/// A host id shared by every process of this machine: from the kernel's boot id, else
/// the host name, hashed (FNV-1a).
pub fn host_id(boot_id: Option<&str>, hostname: &str) -> u64 {
    let src = boot_id
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or(hostname);
    let h = src.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    // 0 is a listener name's (`RdmName::listener`): no host has it.
    h.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_headers_carry_eager_messages_without_data_or_notice() {
        for (op, peer) in [(Op::Tag, false), (Op::Msg, false), (Op::Tag, true)] {
            let h = Header {
                op,
                tag: 0x0123_4567_89ab_cdef,
                data: None,
                len: 64,
                ack: None,
                total: 0,
                peer,
            };
            let b = h.encode_short().unwrap();
            let mut buf = [0xaau8; Header::LEN];
            buf[..Header::SHORT_LEN].copy_from_slice(&b);
            // What lies past the short header is stale bytes of the bounce buffer.
            let (back, body) = Header::decode_at(&buf, Header::SHORT_LEN + 64).unwrap();
            assert_eq!((back, body), (h, Header::SHORT_LEN));
            let (empty, _) = Header::decode_at(&buf, Header::SHORT_LEN).unwrap();
            assert_eq!(empty.len, 0);
            assert_eq!(Header::decode_at(&buf, 11).unwrap_err().errno(), errno::EIO);
            // The full form still reads as before, with its own offset.
            let full = h.encode();
            assert_eq!(
                Header::decode_at(&full, Header::LEN + 64).unwrap(),
                (h, Header::LEN)
            );
        }
        // Data, a notice, or another operation need the full header.
        let mut h = Header::bare(Op::Tag);
        h.data = Some(1);
        assert!(h.encode_short().is_none());
        h.data = None;
        h.ack = Some(3);
        assert!(h.encode_short().is_none());
        assert!(Header::bare(Op::RtsTag).encode_short().is_none());
        assert!(Header::bare(Op::SegMsg).encode_short().is_none());
        // A short header naming anything else, or with data or notice flags, is refused.
        let mut b = Header::bare(Op::Msg).encode_short().unwrap();
        b[1] = Op::Fin as u8;
        assert!(Header::decode_at(&b, 12).is_err());
        let mut b = Header::bare(Op::Msg).encode_short().unwrap();
        b[2] = HAS_DATA;
        assert!(Header::decode_at(&b, 12).is_err());
    }

    #[test]
    fn headerless_messages_read_back_as_sent_whatever_their_tags_and_data() {
        // A sender and a receiver following one connection: each message goes with an
        // immediate when the sender's base allows, else with its header (which both note).
        let (mut tx, mut rx) = (HeaderBase::default(), HeaderBase::default());
        let (mut sent, mut headerless) = (0, 0);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..4000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct high bits and data values, as MPI's (context, rank) give.
            let tag = ((x >> 63) << 40) | (x & 0x3fff_ffff);
            let data = (x & 0x30 != 0).then_some((x >> 56) & 1);
            let h = Header {
                op: if x & 1 == 0 { Op::Tag } else { Op::Msg },
                tag: if x & 1 == 0 { tag } else { 0 },
                data,
                len: i % 1500,
                ack: (x & 0xc0 == 0xc0).then_some(i),
                total: 0,
                peer: x & 0x700 == 0x700,
            };
            sent += 1;
            let back = match h.sets_base() {
                true => match tx.imm(h.op == Op::Tag, h.tag, h.data) {
                    Some(imm) => {
                        headerless += 1;
                        rx.expand(imm, h.len as usize).unwrap()
                    }
                    None => {
                        tx.note(&h);
                        let (b, _) =
                            Header::decode_at(&h.encode(), Header::LEN + h.len as usize).unwrap();
                        assert!(b.sets_base());
                        rx.note(&b);
                        b
                    }
                },
                false => {
                    let (b, _) =
                        Header::decode_at(&h.encode(), Header::LEN + h.len as usize).unwrap();
                    assert!(!b.sets_base(), "{b:?}");
                    b
                }
            };
            assert_eq!(back, h, "message {i}");
            assert_eq!(tx, rx);
        }
        assert_eq!(sent, 4000);
        assert!(
            headerless > 800,
            "{headerless} of {sent} went without a header"
        );
        // A receiver that has seen no tagged header or no data cannot expand one that
        // needs them; a reserved bit is refused too.
        let fresh = HeaderBase::default();
        assert_eq!(fresh.imm(true, 5, None), None);
        assert_eq!(fresh.imm(false, 0, Some(1)), None);
        assert_eq!(fresh.expand(0, 8).unwrap().op, Op::Msg);
        for imm in [IMM_TAGGED | 5, IMM_DATA, IMM_RESERVED] {
            assert_eq!(fresh.expand(imm, 8), None);
        }
        assert_eq!(HeaderBase::unexplained(IMM_DATA, 8).errno(), errno::EIO);
    }

    #[test]
    fn names_round_trip_and_refuse_other_bytes() {
        for a in ["192.168.7.2:4791", "[fe80::1]:18515"] {
            let n = RdmName::new(a.parse().unwrap(), 0x1122_3344_5566_7788, 9);
            let b = n.to_bytes();
            assert_eq!(RdmName::parse(&b).unwrap(), n);
            assert_eq!(n.sockaddr(), a.parse().unwrap());
            assert!(RdmName::parse(&b[..39]).is_err());
            let ev = RdmName {
                rma_event: true,
                ..n
            };
            assert_eq!(RdmName::parse(&ev.to_bytes()).unwrap(), ev);
            assert_ne!(ev.to_bytes(), b);
            let mut c = b;
            c[0] = 0;
            assert_eq!(RdmName::parse(&c).unwrap_err().errno(), errno::EINVAL);
            // A name of another protocol version is refused, saying so.
            let mut c = b;
            c[2] = 1;
            let e = RdmName::parse(&c).unwrap_err();
            assert_eq!(e.errno(), errno::EINVAL);
            assert!(e.to_string().contains("version 1"), "{e}");
        }
        assert!(
            RdmName::parse(&[0u8; 24]).is_err(),
            "a UD name is not an RDM name"
        );
    }

    #[test]
    fn headers_round_trip_and_lengths_must_agree() {
        let h = Header {
            op: Op::Tag,
            tag: u64::MAX - 3,
            data: Some(0xdead_beef_0000_0001),
            len: 100,
            ack: Some(41),
            total: 0,
            peer: false,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b, Header::LEN + 100).unwrap(), h);
        assert!(Header::decode(&b, Header::LEN + 99).is_err());
        assert!(Header::decode(&b[..10], 10).is_err());
        let u = Header::bare(Op::Msg);
        assert_eq!(Header::decode(&u.encode(), Header::LEN).unwrap(), u);
        let mut bad = u.encode();
        bad[1] = 11; // no such operation
        assert_eq!(
            Header::decode(&bad, Header::LEN).unwrap_err().errno(),
            errno::EIO
        );
    }

    #[test]
    fn rendezvous_bodies_round_trip() {
        let r = Rts {
            addr: 0x7f00_1234_5678,
            rkey: 0xabcd,
            size: 5 << 30,
            id: 17,
        };
        assert_eq!(Rts::decode(&r.encode()).unwrap(), r);
        assert!(Rts::decode(&r.encode()[..23]).is_err());
        let f = Fin { id: 3, status: -1 };
        assert_eq!(Fin::decode(&f.encode()).unwrap(), f);
        let h = Header {
            op: Op::RtsTag,
            tag: 9,
            data: None,
            len: Rts::LEN as u32,
            ack: None,
            total: 0,
            peer: false,
        };
        assert_eq!(
            Header::decode(&h.encode(), Header::LEN + Rts::LEN).unwrap(),
            h
        );
        assert!(Op::RtsTag.tagged() && Op::Tag.tagged() && !Op::RtsMsg.tagged());
    }

    #[test]
    fn a_gathered_announcement_lists_its_ranges_after_the_head() {
        let ranges = [
            RtsRange {
                addr: 0x1000,
                len: 70_000,
                rkey: 5,
            },
            RtsRange {
                addr: 0x9_0000,
                len: 1,
                rkey: 6,
            },
            RtsRange {
                addr: 0xff_0000,
                len: 1 << 33,
                rkey: 7,
            },
        ];
        let head = Rts {
            addr: 0,
            rkey: 0,
            size: ranges.iter().map(|r| r.len).sum(),
            id: 4,
        };
        let mut body = head.encode().to_vec();
        ranges
            .iter()
            .for_each(|r| body.extend_from_slice(&r.encode()));
        assert_eq!(Rts::ranges_in(body.len()).unwrap(), 3);
        let back = Rts::decode(&body).unwrap();
        assert_eq!(&*back.decode_ranges(&body[Rts::LEN..]).unwrap(), &ranges);
        // A plain announcement lists none; one listed range, a ragged or overlong tail, and
        // ranges that do not add up to the size are malformed.
        assert_eq!(Rts::ranges_in(Rts::LEN).unwrap(), 0);
        for bad in [Rts::LEN + RtsRange::LEN, Rts::LEN + 50, Rts::LEN - 1] {
            assert_eq!(Rts::ranges_in(bad).unwrap_err().errno(), errno::EIO);
        }
        let long = Rts::LEN + (RTS_RANGES_MAX + 1) * RtsRange::LEN;
        assert!(Rts::ranges_in(long).is_err());
        let short = Rts {
            size: head.size - 1,
            ..head
        };
        assert!(short.decode_ranges(&body[Rts::LEN..]).is_err());
    }

    /// Every piece `plan` gives over `ranges` with landing ranges `landing`.
    fn pieces(ranges: &[RtsRange], landing: &[usize], n: usize, max: usize) -> Vec<Piece> {
        let mut plan = ReadPlan::new(n, max);
        let mut out = vec![];
        while let Some(p) = {
            // Room left in the landing range holding byte `planned`.
            let (mut pos, mut room) = (plan.planned(), usize::MAX);
            for &l in landing {
                if pos < l {
                    room = l - pos;
                    break;
                }
                pos -= l;
            }
            plan.next(ranges, room).unwrap()
        } {
            plan.advance(&p);
            out.push(p);
        }
        out
    }

    #[test]
    fn a_read_plan_covers_the_message_once_within_every_range_and_the_read_size() {
        let r = |len| RtsRange {
            addr: 0,
            len,
            rkey: 0,
        };
        let ranges = [r(70_000), r(0), r(1), r(200_003)];
        let total = 270_004;
        // Remote ranges, landing ranges and the read size all cut pieces.
        let got = pieces(&ranges, &[1000, 100_000, 169_004], total, 65536);
        let mut at = 0;
        for p in &got {
            assert_eq!(p.at, at, "in order, no gap");
            assert!(p.len as usize <= 65536 && p.len > 0);
            assert!(p.offset + p.len as u64 <= ranges[p.range].len);
            at += p.len as usize;
        }
        assert_eq!(at, total);
        let cuts: Vec<_> = got.iter().map(|p| (p.range, p.offset, p.len)).collect();
        assert_eq!(
            &cuts[..5],
            &[
                (0, 0, 1000),
                (0, 1000, 65536),
                (0, 66_536, 3464),
                (2, 0, 1),
                (3, 0, 30_999)
            ]
        );
        // A truncated receive reads only what it holds; one range in one read.
        let got = pieces(&ranges, &[100], 100, 1 << 20);
        assert_eq!(
            got,
            [Piece {
                range: 0,
                offset: 0,
                at: 0,
                len: 100
            }]
        );
        // A message larger than one read: as many reads of the read size as it takes.
        let got = pieces(&[r(3 << 23)], &[], 3 << 23, 1 << 23);
        assert_eq!(got.len(), 3);
        // Ranges shorter than the message, or a landing with no room, are malformed.
        let plan = ReadPlan::new(10, 64);
        assert_eq!(plan.next(&[r(4)], 10).unwrap().unwrap().len, 4);
        let mut short = plan;
        short.advance(&Piece {
            range: 0,
            offset: 0,
            at: 0,
            len: 4,
        });
        assert_eq!(short.next(&[r(4)], 10).unwrap_err().errno(), errno::EIO);
        assert_eq!(plan.next(&[r(10)], 0).unwrap_err().errno(), errno::EIO);
    }

    #[test]
    fn a_first_segment_carries_the_message_size_and_later_ones_none() {
        let h = Header {
            op: Op::SegTag,
            tag: 5,
            data: Some(1),
            len: 8160,
            ack: Some(2),
            total: 20_000,
            peer: false,
        };
        assert_eq!(Header::decode(&h.encode(), Header::LEN + 8160).unwrap(), h);
        assert!(Op::SegTag.tagged() && !Op::SegMsg.tagged() && !Op::Cont.tagged());
        // A "first segment" as large as its message is malformed.
        let whole = Header { total: 8160, ..h };
        assert_eq!(
            Header::decode(&whole.encode(), Header::LEN + 8160)
                .unwrap_err()
                .errno(),
            errno::EIO
        );
        let c = Header {
            op: Op::Cont,
            tag: 0,
            data: None,
            len: 3680,
            ack: None,
            total: 0,
            peer: false,
        };
        assert_eq!(Header::decode(&c.encode(), Header::LEN + 3680).unwrap(), c);
    }

    #[test]
    fn first_send_connects_and_later_ones_wait_then_post() {
        let mut p = PeerLink::<u32>::default();
        assert_eq!(p.send_path(), SendPath::Connect);
        p.connecting(1);
        assert_eq!(p.send_path(), SendPath::Wait);
        assert!(p.established(1));
        assert_eq!(p.send_path(), SendPath::Post(1));
        assert!(p.disconnected(1));
        assert_eq!(p.send_path(), SendPath::Connect, "a later send reconnects");
    }

    #[test]
    fn simultaneous_connects_keep_the_lower_names_connection_on_both_sides() {
        let (low, high) = (b"aaaa".as_slice(), b"bbbb".as_slice());
        // Each side started its own connect, then sees the other's request.
        let mut at_low = PeerLink::<u32>::default();
        at_low.connecting(10);
        let mut at_high = PeerLink::<u32>::default();
        at_high.connecting(20);
        assert_eq!(at_low.request(low, high), Request::Reject);
        assert_eq!(at_high.request(high, low), Request::Accept);
        at_high.accepting(21);
        // The high side's own connect is refused by the low side: expected, no error.
        assert!(!at_high.failed(20));
        assert!(at_high.established(21));
        assert!(at_low.established(10));
        assert_eq!(at_low.send_path(), SendPath::Post(10));
        assert_eq!(at_high.send_path(), SendPath::Post(21));
    }

    #[test]
    fn a_race_against_a_peer_known_by_its_listener_alone_has_one_winner() {
        // A's peer knows A by node and service (no host id, no nonce); A knows it whole.
        let a = RdmName {
            rma_event: true,
            ..RdmName::new("10.0.0.1:9228".parse().unwrap(), 77, 5)
        };
        let b = RdmName::new("10.0.0.2:40000".parse().unwrap(), 88, 6);
        let a_seen_by_b = RdmName::listener(a.sockaddr());
        assert_eq!((a_seen_by_b.host, a_seen_by_b.nonce), (0, 0));
        assert_eq!(
            RdmName::parse(&a_seen_by_b.to_bytes()).unwrap(),
            a_seen_by_b
        );
        let (ab, bb, ab_b) = (a.to_bytes(), b.to_bytes(), a_seen_by_b.to_bytes());
        let mut at_a = PeerLink::<u32>::default();
        at_a.connecting(1);
        let mut at_b = PeerLink::<u32>::default();
        at_b.connecting(2);
        // Whole bytes would order the two differently on each side (the host ids, the
        // flags); the listeners' addresses do not.
        let (ra, rb) = (at_a.request(&ab, &bb), at_b.request(&bb, &ab_b));
        assert_ne!(ra, rb, "exactly one side accepts");
        assert_eq!(
            ra,
            Request::Reject,
            "A's listener is the lower: A's connect wins"
        );
    }

    #[test]
    fn a_request_says_when_its_sender_knows_the_peer_by_its_listener_alone() {
        let own = RdmName::new("10.0.0.2:40000".parse().unwrap(), 88, 6);
        let plain = RdmName::request_bytes(&own.to_bytes(), false);
        let marked = RdmName::request_bytes(&own.to_bytes(), true);
        assert!(!RdmName::requested_by_listener(&plain));
        assert!(RdmName::requested_by_listener(&marked));
        // The mark leaves the name itself as it was.
        assert_eq!(RdmName::parse(&marked).unwrap(), own);
        assert!(RdmName::listener(own.sockaddr()).is_listener());
        assert!(!own.is_listener());
    }

    #[test]
    fn no_host_has_a_listener_names_host_id() {
        assert_ne!(host_id(None, ""), 0);
        assert_ne!(host_id(Some("x"), "y"), 0);
    }

    #[test]
    fn a_refused_connect_fails_its_sends_and_duplicates_are_refused() {
        let mut p = PeerLink::<u32>::default();
        p.connecting(3);
        assert!(p.failed(3));
        assert_eq!(p.send_path(), SendPath::Connect);
        assert!(!p.failed(3), "reported once");
        p.connecting(4);
        p.established(4);
        assert_eq!(p.request(b"b", b"a"), Request::Reject, "already connected");
        assert!(!p.disconnected(99), "an unknown connection changes nothing");
        assert_eq!(p.send_path(), SendPath::Post(4));
    }

    #[test]
    fn host_ids_follow_the_boot_id() {
        assert_eq!(host_id(Some("abc\n"), "x"), host_id(Some("abc"), "y"));
        assert_ne!(host_id(Some("abc"), "x"), host_id(Some("abd"), "x"));
        assert_eq!(host_id(None, "node1"), host_id(Some(""), "node1"));
    }

    #[test]
    fn fixed_ring_keeps_order_across_the_wrap_and_refuses_when_full() {
        let mut r = FixedRing::<(u64, u32), 4>::default();
        assert!(r.is_empty() && r.front().is_none() && r.pop_front().is_none());
        let mut next = 0u64;
        let mut want = std::collections::VecDeque::new();
        // Uneven pushes and pops walk the head around the array several times.
        for round in 0..20u64 {
            for _ in 0..(round % 4 + 1) {
                let ok = r.push_back((next, next as u32 * 3));
                assert_eq!(ok, want.len() < 4, "full at {}", want.len());
                if ok {
                    want.push_back((next, next as u32 * 3));
                }
                next += 1;
            }
            assert_eq!(r.len(), want.len());
            for _ in 0..(round % 3 + 1) {
                assert_eq!(r.front(), want.front().copied());
                assert_eq!(r.pop_front(), want.pop_front());
            }
        }
        while let Some(v) = want.pop_front() {
            assert_eq!(r.pop_front(), Some(v));
        }
        assert!(r.is_empty());
    }
}
