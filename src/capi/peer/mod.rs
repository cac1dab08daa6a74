//! What other providers call into (fi_peer(3), owner side): the shared receive context
//! (`fid_peer_srx`), a CQ (`fid_peer_cq`), an AV (`fid_peer_av`) and an AV set
//! (`fid_peer_av_set`) as peers see them. This part imports neither the provider face nor
//! the extension interface; both build on it.

pub(crate) mod av;
pub(crate) mod av_set;
pub(crate) mod cq;
pub(crate) mod srx;
