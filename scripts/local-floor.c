/* The least an owner can cost over libfabric 1.17's shm (issue 18's budget).
 *
 * Two processes on one host ping-pong 2-byte messages over shm, in one of two modes:
 *   plain  shm alone: fi_trecv, fi_tinject and fi_cq_read on shm's own objects;
 *   owner  shm imported the way rverbs imports it (fi_peer(3)): receives posted to the
 *          owner's queue, shm asking for them through the owner's get_tag/free_entry, and
 *          shm's CQ (1.17.0 refuses FI_PEER CQs) read and copied out by the owner's CQ read.
 * The owner here is the least one that works: a ring of posted receives matched from its
 * head, no locks, no checks, no verbs CQ to poll. What it costs beyond "plain" is what any
 * owner built on 1.17's shm pays per round trip, however lean its own code.
 *
 * Each process writes its shm name to DIR/ROLE and reads the other's. Only the timed loop
 * is collected under callgrind (--collect-atstart=no: CALLGRIND_TOGGLE_COLLECT around it).
 *
 * The client pauses (uncollected) after each send so that the answer is in when it reads:
 * empty CQ reads would vary with scheduling. It prints how many it still made, and role
 * "idle" makes only empty reads, to price one (subtracted by scripts/local-floor).
 *
 * Built with -DLOCKED, "owner" takes a mutex around each of the owner's own steps (posting,
 * get_tag, queue_tag, free_entry, copying completions out), never across shm's calls: what
 * a thread-safe owner adds.
 *
 * With "msg" the messages are untagged (fi_inject, fi_recv, get_msg), as fi_pingpong's are.
 *
 *   local-floor plain|owner server|client|idle ITERS DIR [msg]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_ext.h>
#include <rdma/fi_tagged.h>
#include <valgrind/callgrind.h>

#define CHECK(call)                                                              \
	do {                                                                     \
		int rc_ = (int)(call);                                           \
		if (rc_) {                                                       \
			fprintf(stderr, "%s: %s (%d)\n", #call, fi_strerror(-rc_), \
				rc_);                                            \
			exit(1);                                                 \
		}                                                                \
	} while (0)

static struct fid_ep *shm_ep;
static struct fid_cq *shm_cq;
static int owner;
#ifdef LOCKED
/* Built with -DLOCKED: the owner's calls take a lock, as a thread-safe owner's must. */
static pthread_mutex_t owner_lock = PTHREAD_MUTEX_INITIALIZER;
#define LOCK() pthread_mutex_lock(&owner_lock)
#define UNLOCK() pthread_mutex_unlock(&owner_lock)
#else
#define LOCK() ((void)0)
#define UNLOCK() ((void)0)
#endif

/* The owner: a ring of posted receives, matched from the head. */
#define RING 16
struct posted {
	void *buf;
	size_t len;
	uint64_t tag;
	void *context;
};
static struct posted ring[RING];
static unsigned head, tail;
/* The entry handed to shm for a matched receive, and for an unexpected message (a
 * ping-pong has at most one message in flight each way). */
static struct fi_peer_rx_entry matched, unexp;
static struct iovec matched_iov;
static void *null_desc[1];
static int have_unexp;
static struct fid_peer_srx owner_srx;

/* Tagged (the default) or untagged ("msg" on the command line) messages. */
static int tagged = 1;

/* The arrival: the ring's head takes it if it is for this tag (any, untagged). */
static inline int owner_get(fi_addr_t addr, uint64_t tag, struct fi_peer_rx_entry **entry)
{
	LOCK();
	if (head != tail && (!tagged || ring[head % RING].tag == tag)) {
		struct posted *p = &ring[head++ % RING];
		matched_iov.iov_base = p->buf;
		matched_iov.iov_len = p->len;
		matched.addr = addr;
		matched.tag = tag;
		matched.context = p->context;
		matched.flags = (tagged ? FI_TAGGED : FI_MSG) | FI_RECV | FI_COMPLETION;
		matched.iov = &matched_iov;
		matched.desc = null_desc;
		matched.count = 1;
		*entry = &matched;
		UNLOCK();
		return 0;
	}
	unexp.addr = addr;
	unexp.tag = tag;
	*entry = &unexp;
	UNLOCK();
	return -FI_ENOENT;
}

static int owner_get_tag(struct fid_peer_srx *srx, fi_addr_t addr, uint64_t tag,
			 struct fi_peer_rx_entry **entry)
{
	return owner_get(addr, tag, entry);
}

static int owner_get_msg(struct fid_peer_srx *srx, fi_addr_t addr, size_t size,
			 struct fi_peer_rx_entry **entry)
{
	return owner_get(addr, 0, entry);
}

static int owner_queue_tag(struct fi_peer_rx_entry *entry)
{
	LOCK();
	have_unexp = 1;
	UNLOCK();
	return 0;
}

static int owner_queue_msg(struct fi_peer_rx_entry *entry)
{
	return owner_queue_tag(entry);
}

static void owner_free_entry(struct fi_peer_rx_entry *entry)
{
	LOCK();
	if (entry == &unexp)
		have_unexp = 0;
	UNLOCK();
}

static struct fi_ops_srx_owner owner_ops = {
	.size = sizeof(struct fi_ops_srx_owner),
	.get_msg = owner_get_msg,
	.get_tag = owner_get_tag,
	.queue_msg = owner_queue_msg,
	.queue_tag = owner_queue_tag,
	.free_entry = owner_free_entry,
};

static int owner_close(struct fid *fid)
{
	return 0;
}

static struct fi_ops owner_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = owner_close,
	.bind = NULL,
	.control = NULL,
	.ops_open = NULL,
};


static __attribute__((noinline)) void post_recv(void *buf, size_t len, uint64_t tag, void *ctx)
{
	if (!owner) {
		ssize_t rc;
		do
			rc = tagged ? fi_trecv(shm_ep, buf, len, NULL, FI_ADDR_UNSPEC, tag, 0, ctx)
				    : fi_recv(shm_ep, buf, len, NULL, FI_ADDR_UNSPEC, ctx);
		while (rc == -FI_EAGAIN);
		CHECK(rc);
		return;
	}
	LOCK();
	if (have_unexp && (!tagged || unexp.tag == tag)) {
		/* A message that came first: shm copies it once told where. */
		matched_iov.iov_base = buf;
		matched_iov.iov_len = len;
		unexp.context = ctx;
		unexp.flags = (tagged ? FI_TAGGED : FI_MSG) | FI_RECV | FI_COMPLETION;
		unexp.iov = &matched_iov;
		unexp.desc = null_desc;
		unexp.count = 1;
		UNLOCK();
		/* shm calls free_entry from start_*: not under the lock. */
		CHECK(tagged ? owner_srx.peer_ops->start_tag(&unexp)
			     : owner_srx.peer_ops->start_msg(&unexp));
		return;
	}
	ring[tail++ % RING] = (struct posted){ buf, len, tag, ctx };
	UNLOCK();
}

/* The owner's send: its address translated to shm's, then shm's inject. */
static fi_addr_t shm_addr[1];
static __attribute__((noinline)) ssize_t send_tag(const void *buf, size_t len, fi_addr_t to,
						  uint64_t tag)
{
	if (owner)
		to = shm_addr[to];
	return tagged ? fi_tinject(shm_ep, buf, len, to, tag) : fi_inject(shm_ep, buf, len, to);
}

/* The owner's CQ read: shm's CQ read (its progress), its entries copied out. */
static __attribute__((noinline)) ssize_t read_cq(struct fi_cq_tagged_entry *out, size_t n)
{
	if (!owner)
		return fi_cq_read(shm_cq, out, n);
	struct fi_cq_tagged_entry got[4];
	ssize_t rc = fi_cq_read(shm_cq, got, n < 4 ? n : 4);
	if (rc <= 0)
		return rc;
	LOCK();
	for (ssize_t i = 0; i < rc; i++)
		out[i] = got[i];
	UNLOCK();
	return rc;
}

static void write_name(const char *dir, const char *role, const void *name, size_t len)
{
	char path[4096], tmp[4096];
	snprintf(path, sizeof path, "%s/%s", dir, role);
	snprintf(tmp, sizeof tmp, "%s/.%s", dir, role);
	FILE *f = fopen(tmp, "w");
	if (!f || fwrite(name, 1, len, f) != len || fclose(f)) {
		perror(tmp);
		exit(1);
	}
	if (rename(tmp, path)) {
		perror(path);
		exit(1);
	}
}

static size_t read_name(const char *dir, const char *role, char *name, size_t cap)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/%s", dir, role);
	for (int i = 0; i < 30000; i++) {
		FILE *f = fopen(path, "r");
		if (f) {
			size_t n = fread(name, 1, cap, f);
			fclose(f);
			return n;
		}
		usleep(1000);
	}
	fprintf(stderr, "waited 30 s for %s: is the other side running?\n", path);
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc < 5 || argc > 6 || (argc == 6 && strcmp(argv[5], "msg")) ||
	    (strcmp(argv[1], "plain") && strcmp(argv[1], "owner")) ||
	    (strcmp(argv[2], "server") && strcmp(argv[2], "client") && strcmp(argv[2], "idle"))) {
		fprintf(stderr, "usage: local-floor plain|owner server|client|idle ITERS DIR [msg]\n");
		return 2;
	}
	owner = !strcmp(argv[1], "owner");
	int server = !strcmp(argv[2], "server");
	int idle = !strcmp(argv[2], "idle");
	long iters = atol(argv[3]);
	const char *dir = argv[4];
	tagged = argc == 5;

	struct fi_info *hints = fi_allocinfo(), *info;
	hints->caps = FI_MSG | FI_TAGGED;
	hints->ep_attr->type = FI_EP_RDM;
	hints->domain_attr->av_type = FI_AV_TABLE;
	hints->fabric_attr->prov_name = strdup("shm");
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
	CHECK(fi_domain(fabric, info, &domain, NULL));
	struct fi_av_attr aa = { .type = FI_AV_TABLE };
	CHECK(fi_av_open(domain, &aa, &av, NULL));
	struct fi_cq_attr ca = { .format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_NONE };
	CHECK(fi_cq_open(domain, &ca, &shm_cq, NULL));
	CHECK(fi_endpoint(domain, info, &shm_ep, NULL));
	if (owner) {
		struct fi_peer_srx_context ctx = { .size = sizeof ctx, .srx = &owner_srx };
		struct fi_rx_attr ra = { .op_flags = FI_PEER };
		struct fid_ep *srx;
		owner_srx.ep_fid.fid.fclass = FI_CLASS_SRX_CTX;
		owner_srx.ep_fid.fid.ops = &owner_fid_ops;
		owner_srx.owner_ops = &owner_ops;
		CHECK(fi_srx_context(domain, &ra, &srx, &ctx));
		/* shm is bound to the owner's SRX, as rverbs binds it. */
		CHECK(fi_ep_bind(shm_ep, &owner_srx.ep_fid.fid, 0));
	}
	CHECK(fi_ep_bind(shm_ep, &shm_cq->fid, FI_TRANSMIT | FI_RECV));
	CHECK(fi_ep_bind(shm_ep, &av->fid, 0));
	CHECK(fi_enable(shm_ep));

	if (idle) {
		struct fi_cq_tagged_entry e[4];
		CALLGRIND_TOGGLE_COLLECT;
		for (long i = 0; i < iters; i++)
			if (read_cq(e, 4) != -FI_EAGAIN)
				return 1;
		CALLGRIND_TOGGLE_COLLECT;
		printf("%s idle: %ld empty CQ reads\n", argv[1], iters);
		return 0;
	}
	char name[256], peer[256];
	size_t len = sizeof name;
	CHECK(fi_getname(&shm_ep->fid, name, &len));
	write_name(dir, argv[2], name, len);
	read_name(dir, server ? "client" : "server", peer, sizeof peer);
	fi_addr_t to;
	if (fi_av_insert(av, peer, 1, &to, 0, NULL) != 1) {
		fprintf(stderr, "fi_av_insert took no address\n");
		return 1;
	}
	/* The owner's address 0 is shm's `to`. */
	shm_addr[0] = to;
	if (owner)
		to = 0;

	char tx[2] = { 1, 2 }, rx[2];
	long empty = 0;
	struct fi_cq_tagged_entry e[4];
	ssize_t rc;
	long warm = 100;
	for (long i = 0; i < warm + iters; i++) {
		if (i == warm)
			CALLGRIND_TOGGLE_COLLECT;
		rx[0] = rx[1] = 0;
		post_recv(rx, sizeof rx, 7, rx);
		if (!server) {
			while ((rc = send_tag(tx, sizeof tx, to, 7)) == -FI_EAGAIN)
				read_cq(e, 4);
			CHECK(rc);
			/* The server's answer is in by the time the client looks: no spinning
			 * (the pause is not collected). */
			if (i >= warm) {
				CALLGRIND_TOGGLE_COLLECT;
				usleep(50);
				CALLGRIND_TOGGLE_COLLECT;
			}
		}
		for (;;) {
			rc = read_cq(e, 4);
			if (rc == 1 && e[0].op_context == rx && e[0].len == sizeof rx)
				break;
			if (rc != -FI_EAGAIN) {
				fprintf(stderr, "fi_cq_read: %zd, not the receive's completion\n", rc);
				return 1;
			}
			if (i >= warm)
				empty++;
		}
		if (rx[0] != tx[0] || rx[1] != tx[1]) {
			fprintf(stderr, "round trip %ld: received %d %d, sent %d %d\n", i, rx[0],
				rx[1], tx[0], tx[1]);
			return 1;
		}
		if (server) {
			while ((rc = send_tag(tx, sizeof tx, to, 7)) == -FI_EAGAIN)
				read_cq(e, 4);
			CHECK(rc);
		}
	}
	CALLGRIND_TOGGLE_COLLECT;
	printf("%s %s: %ld round trips, %ld empty CQ reads\n", argv[1], argv[2], iters, empty);
	/* The server's last reply is read before anyone closes. */
	sleep(1);
	fi_close(&shm_ep->fid);
	fi_close(&shm_cq->fid);
	fi_close(&av->fid);
	fi_close(&domain->fid);
	fi_close(&fabric->fid);
	fi_freeinfo(info);
	return 0;
}
