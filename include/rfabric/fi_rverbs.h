/*
 * rverbs' extension interface (fi_open_ops on an rverbs domain): rverbs as the owner of
 * peer providers (fi_peer(3)).
 *
 *   struct fi_rverbs_peer_ops *ops;
 *   fi_open_ops(&domain->fid, FI_RVERBS_PEER_OPS, 0, (void **) &ops, NULL);
 */
#ifndef FI_RVERBS_H
#define FI_RVERBS_H

#include <rdma/fabric.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_collective.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FI_RVERBS_PEER_OPS "rverbs_peer_v1"

struct fi_rverbs_peer_ops {
	size_t size;
	/*
	 * Imports libfabric's shm provider as a peer of a software SRX (fi_srx_context with
	 * FI_TAGGED or FI_DIRECTED_RECV in the rx caps) that has its CQ bound (FI_RECV).
	 * Messages sent by shm endpoints to the import's name land in receives posted to the
	 * SRX and complete in its CQ; reads of that CQ drive shm. Close the import with
	 * fi_close before the SRX.
	 */
	int (*import_shm)(struct fid_ep *srx, struct fid **import);
	/* The import's shm name (FI_ADDR_STR, NUL included), as fi_getname reports names. */
	int (*import_name)(struct fid *import, void *addr, size_t *addrlen);
	/*
	 * FI_PEER_TRANSFER: calls the peer's fi_endpoint2(peer_domain, peer_info, peer_ep,
	 * FI_PEER_TRANSFER, ctx) with ctx.info = owner_info and ctx.ep = *transfer, a
	 * transfer endpoint over rverbs' enabled MSG endpoint ep. What the peer posts on
	 * *transfer completes through its complete/comperr callbacks (ep argument: the peer's
	 * endpoint), never on the application's CQ. fi_close(&(*transfer)->fid) closes the
	 * peer's endpoint, then the link.
	 */
	int (*open_transfer)(struct fid_ep *ep, struct fid_domain *peer_domain,
			     struct fi_info *peer_info, struct fi_info *owner_info,
			     struct fid_ep **transfer, struct fid_ep **peer_ep);
	/*
	 * Peer domain: calls the peer's fi_domain2(peer_fabric, peer_info, peer_domain,
	 * FI_PEER, ctx) with ctx.domain = domain (an rverbs domain, which the peer may use,
	 * e.g. to register memory). The domain must outlive the peer's.
	 */
	int (*open_peer_domain)(struct fid_domain *domain, struct fid_fabric *peer_fabric,
				struct fi_info *peer_info, struct fid_domain **peer_domain);
	/*
	 * Peer EQ: calls the peer's fi_eq_open(peer_fabric, attr + FI_PEER, peer_eq, ctx)
	 * with ctx.eq = eq (an rverbs EQ, where the peer writes its events with fi_eq_write).
	 * The EQ must outlive the peer's.
	 */
	int (*open_peer_eq)(struct fid_eq *eq, struct fid_fabric *peer_fabric,
			    struct fi_eq_attr *attr, struct fid_eq **peer_eq);
	/*
	 * Peer AV set: calls the peer's fi_av_set(peer_av, attr{.flags = FI_PEER},
	 * peer_set, ctx) with ctx.av_set = the owner face (struct fid_peer_av_set) of set,
	 * an rverbs AV set, whose members() lists the set's addresses.
	 */
	int (*open_peer_av_set)(struct fid_av_set *set, struct fid_av *peer_av,
				struct fid_av_set **peer_set);
	/*
	 * Peer AV: calls the peer's fi_av_open(peer_domain, attr + FI_PEER, peer_av, ctx)
	 * with ctx.av = the owner face (struct fid_peer_av: query, ep_addr) of av, an rverbs
	 * AV, which must outlive the peer's.
	 */
	int (*open_peer_av)(struct fid_av *av, struct fid_domain *peer_domain,
			    struct fi_av_attr *attr, struct fid_av **peer_av);
};

#ifdef __cplusplus
}
#endif

#endif /* FI_RVERBS_H */
