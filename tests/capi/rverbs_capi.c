/* The C ABI test: an application written against libfabric 1.17's headers opens every rverbs
 * object through libfabric's core and runs traffic over SoftRoCE in one process.
 *
 *   msg    connection management with data, send/recv, senddata, inject, multi-recv, a
 *          shared receive context, CQ error entries, EQ reads (FI_PEEK, too-small buffers)
 *   dgram  address vectors, names, send/recv, senddata, inject
 *   bad    the error codes of bad calls; nothing crashes
 *   rdm-mr-cache  unregistered rendezvous buffers unmapped, emptied and moved between
 *          messages carry their new bytes (the registration cache never goes stale);
 *          inaccessible buffers fail cleanly
 *
 * Built by tests/verbs_capi.rs with the system compiler; run with FI_PROVIDER_PATH naming
 * the directory holding librverbs-fi.so. Prints "ok <section>" per section; exits 1 with
 * the failing line otherwise. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_ext.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_collective.h>
#include <rfabric/fi_rverbs.h>
#include <sys/wait.h>
#include <unistd.h>

#define FAIL(...)                                                                           \
	do {                                                                                \
		fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                             \
		fprintf(stderr, __VA_ARGS__);                                               \
		fprintf(stderr, "\n");                                                      \
		exit(1);                                                                    \
	} while (0)

/* A call that must succeed (return >= 0). */
#define OK(x)                                                                               \
	do {                                                                                \
		long _r = (long)(x);                                                        \
		if (_r < 0)                                                                 \
			FAIL("%s = %ld (%s)", #x, _r, fi_strerror((int)-_r));               \
	} while (0)

/* A call that must return exactly `want`. */
#define EXPECT(x, want)                                                                     \
	do {                                                                                \
		long _r = (long)(x), _w = (long)(want);                                     \
		if (_r != _w)                                                               \
			FAIL("%s = %ld (%s), expected %ld (%s)", #x, _r,                    \
			     _r < 0 ? fi_strerror((int)-_r) : "", _w,                       \
			     _w < 0 ? fi_strerror((int)-_w) : "");                          \
	} while (0)

#define TRUE(c)                                                                             \
	do {                                                                                \
		if (!(c))                                                                   \
			FAIL("%s is false", #c);                                            \
	} while (0)

#define BUF 65536

static struct fi_info *hints_for(enum fi_ep_type type)
{
	struct fi_info *h = fi_allocinfo();
	TRUE(h);
	h->ep_attr->type = type;
	h->caps = FI_MSG;
	h->mode = 0;
	h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR;
	h->fabric_attr->prov_name = strdup("rverbs");
	return h;
}

/* RDM hints with `caps`, asking nothing of the caller (mode 0, mr_mode 0). */
static struct fi_info *rdm_hints(uint64_t caps)
{
	struct fi_info *h = fi_allocinfo();
	TRUE(h);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = caps;
	h->mode = 0;
	h->domain_attr->mr_mode = 0;
	h->fabric_attr->prov_name = strdup("rverbs");
	return h;
}

/* Reads one completion within 10 s; returns 1, or -FI_EAVAIL when an error is next. */
static long cq_wait_at(int line, struct fid_cq *cq, struct fi_cq_data_entry *e)
{
	time_t end = time(NULL) + 10;
	for (;;) {
		long r = fi_cq_read(cq, e, 1);
		if (r != -FI_EAGAIN)
			return r;
		if (time(NULL) > end)
			FAIL("line %d: no completion within 10 s", line);
	}
}

#define cq_wait(...) cq_wait_at(__LINE__, __VA_ARGS__)
#define cq_expect(...) cq_expect_at(__LINE__, __VA_ARGS__)

static void cq_expect_at(int line, struct fid_cq *cq, void *ctx, uint64_t flag, size_t len,
			 struct fi_cq_data_entry *out)
{
	struct fi_cq_data_entry e;
	EXPECT(cq_wait_at(line, cq, &e), 1);
	if (e.op_context != ctx || !(e.flags & flag) || ((flag & FI_RECV) && e.len != len))
		FAIL("line %d: completion ctx %p flags %#lx len %zu; expected ctx %p flag %#lx len %zu",
		     line, e.op_context, (unsigned long)e.flags, e.len, ctx, (unsigned long)flag, len);
	if (out)
		*out = e;
}

static void fill(uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(seed + i * 7);
}

static void check(const uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != (uint8_t)(seed + i * 7))
			FAIL("byte %zu is %u, expected %u", i, p[i], (uint8_t)(seed + i * 7));
}

/* An EQ event of `want` within 10 s, with the entry. */
static void eq_expect(struct fid_eq *eq, uint32_t want, struct fi_eq_cm_entry *cm, size_t len)
{
	uint32_t ev = 0;
	long r = fi_eq_sread(eq, &ev, cm, len, 10000, 0);
	if (r == -FI_EAVAIL) {
		struct fi_eq_err_entry err = {0};
		fi_eq_readerr(eq, &err, 0);
		FAIL("EQ error %d (%s), prov_errno %d: %s", err.err, fi_strerror(err.err),
		     err.prov_errno, fi_eq_strerror(eq, err.prov_errno, err.err_data, NULL, 0));
	}
	OK(r);
	EXPECT(ev, want);
}

struct side {
	struct fid_ep *ep;
	struct fid_cq *cq;
	struct fid_eq *eq;
};

struct msg_env {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_pep *pep;
	struct fid_eq *peq;
	struct fid_mr *mr;
	uint8_t *buf;
	void *desc;
	struct sockaddr_in addr;
};

/* Fabric, domain, a registered buffer and a listening passive endpoint. */
static void msg_env_open(struct msg_env *m, struct fi_info *h)
{
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC};

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &m->info));
	TRUE(strcmp(m->info->fabric_attr->prov_name, "rverbs") == 0);
	OK(fi_fabric(m->info->fabric_attr, &m->fabric, NULL));
	OK(fi_domain(m->fabric, m->info, &m->domain, NULL));
	OK(fi_eq_open(m->fabric, &ea, &m->peq, NULL));
	m->buf = aligned_alloc(4096, BUF);
	OK(fi_mr_reg(m->domain, m->buf, BUF, FI_SEND | FI_RECV, 0, 0, 0, &m->mr, NULL));
	m->desc = fi_mr_desc(m->mr);

	OK(fi_passive_ep(m->fabric, m->info, &m->pep, NULL));
	OK(fi_pep_bind(m->pep, &m->peq->fid, 0));
	OK(fi_listen(m->pep));
}

static void msg_env_close(struct msg_env *m)
{
	EXPECT(fi_close(&m->pep->fid), 0);
	EXPECT(fi_close(&m->mr->fid), 0);
	EXPECT(fi_close(&m->peq->fid), 0);
	EXPECT(fi_close(&m->domain->fid), 0);
	EXPECT(fi_close(&m->fabric->fid), 0);
	fi_freeinfo(m->info);
	free(m->buf);
}

/* The CQ format of the pairs connect_pair makes, and default receive flags its server
 * endpoint gets (rx_attr.op_flags of the connection request's info). */
static enum fi_cq_format pair_format = FI_CQ_FORMAT_DATA;
static uint64_t pair_rx_op_flags;
static uint64_t pair_caps = FI_MSG; /* the client's hints caps */
static uint64_t pair_cq_flags;      /* added to FI_TRANSMIT | FI_RECV on both sides */
/* Counters the next pair binds (client, server) before enabling, with their bind flags. */
static struct fid_cntr *pair_cntr[2];
static uint64_t pair_cntr_flags[2];
static enum fi_wait_obj pair_cq_wait = FI_WAIT_NONE; /* the next pair's CQs' */

static void open_cq(struct fid_domain *d, struct fid_cq **cq)
{
	struct fi_cq_attr a = {.format = pair_format, .wait_obj = pair_cq_wait};
	OK(fi_cq_open(d, &a, cq, NULL));
}

/* The server half of a connection: reads the request `c` (connecting with "hello") made,
 * accepts it on a new endpoint taking receives from `srx` when given, and waits until both
 * sides are connected. */
static void accept_request(struct msg_env *m, struct side *s, struct side *c, struct fid_ep *srx)
{
	uint8_t cmbuf[sizeof(struct fi_eq_cm_entry) + 64];
	struct fi_eq_cm_entry *cm = (void *)cmbuf;

	/* Peeks of the request hand out one info, the one the read then takes (issue 15,
	 * finding 11: each peek used to allocate an info and a handle nobody freed). */
	{
		uint32_t ev = 0;
		long r;
		struct fi_info *first;
		while ((r = fi_eq_read(m->peq, &ev, cm, sizeof cmbuf, FI_PEEK)) == -FI_EAGAIN)
			;
		OK(r);
		EXPECT(ev, FI_CONNREQ);
		first = cm->info;
		OK(fi_eq_read(m->peq, &ev, cm, sizeof cmbuf, FI_PEEK));
		TRUE(cm->info == first);
		eq_expect(m->peq, FI_CONNREQ, cm, sizeof cmbuf);
		TRUE(cm->info == first);
	}
	TRUE(cm->fid == &m->pep->fid);
	TRUE(cm->info && cm->info->handle);
	TRUE(memcmp(cm->data, "hello", 5) == 0);
	s->eq = m->peq;
	open_cq(m->domain, &s->cq);
	cm->info->rx_attr->op_flags |= pair_rx_op_flags;
	OK(fi_endpoint(m->domain, cm->info, &s->ep, s));
	OK(fi_ep_bind(s->ep, &m->peq->fid, 0));
	OK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV | pair_cq_flags));
	if (pair_cntr[1])
		OK(fi_ep_bind(s->ep, &pair_cntr[1]->fid, pair_cntr_flags[1]));
	if (srx)
		OK(fi_ep_bind(s->ep, &srx->fid, 0));
	OK(fi_enable(s->ep));
	OK(fi_accept(s->ep, "world", 5));
	fi_freeinfo(cm->info);

	/* The active side first: rdma_cm completes the handshake when it reads its event. */
	eq_expect(c->eq, FI_CONNECTED, cm, sizeof cmbuf);
	TRUE(cm->fid == &c->ep->fid);
	TRUE(memcmp(cm->data, "world", 5) == 0);
	eq_expect(m->peq, FI_CONNECTED, cm, sizeof cmbuf);
	TRUE(cm->fid == &s->ep->fid);
}

/* Connects a client endpoint to the passive endpoint; the server side accepts, taking its
 * receives from `srx` when given. Connection data goes both ways. */
static void connect_pair(struct msg_env *m, struct side *s, struct side *c, struct fid_ep *srx)
{
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC};
	struct fi_info *h = hints_for(FI_EP_MSG), *ci;

	h->caps = pair_caps;
	h->addr_format = FI_SOCKADDR_IN;
	h->dest_addr = malloc(sizeof m->addr);
	memcpy(h->dest_addr, &m->addr, sizeof m->addr);
	h->dest_addrlen = sizeof m->addr;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &ci));
	OK(fi_eq_open(m->fabric, &ea, &c->eq, NULL));
	open_cq(m->domain, &c->cq);
	OK(fi_endpoint(m->domain, ci, &c->ep, c));
	OK(fi_ep_bind(c->ep, &c->eq->fid, 0));
	OK(fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV | pair_cq_flags));
	if (pair_cntr[0])
		OK(fi_ep_bind(c->ep, &pair_cntr[0]->fid, pair_cntr_flags[0]));
	OK(fi_enable(c->ep));
	OK(fi_connect(c->ep, &m->addr, "hello", 5));

	accept_request(m, s, c, srx);
	fi_freeinfo(ci);
	fi_freeinfo(h);
}

/* One message of `len` bytes (filled from `seed`) from the client to the server of a
 * connected pair, through the buffers of `m`: both completions and every byte checked. */
static void send_checked(struct msg_env *m, struct side *s, struct side *c, size_t len,
			 uint8_t seed)
{
	uint8_t *rx = m->buf, *tx = m->buf + 32768;
	int ctx[2];

	fill(tx, len, seed);
	OK(fi_recv(s->ep, rx, 8192, m->desc, 0, &ctx[0]));
	OK(fi_send(c->ep, tx, len, m->desc, 0, &ctx[1]));
	cq_expect(c->cq, &ctx[1], FI_SEND, 0, NULL);
	cq_expect(s->cq, &ctx[0], FI_RECV, len, NULL);
	check(rx, len, seed);
}

static void close_side(struct side *x, int own_eq)
{
	EXPECT(fi_close(&x->ep->fid), 0);
	EXPECT(fi_close(&x->cq->fid), 0);
	if (own_eq)
		EXPECT(fi_close(&x->eq->fid), 0);
}

static void msg_section(void)
{
	struct msg_env m = {0};
	struct side s = {0}, c = {0}, s2 = {0}, c2 = {0};
	struct fi_info *h = hints_for(FI_EP_MSG);
	struct fi_cq_data_entry e;
	int ctx[16];
	size_t len;

	msg_env_open(&m, h);
	/* fi_getname with no room says how much it needs (fi_pingpong relies on it). */
	len = 0;
	EXPECT(fi_getname(&m.pep->fid, NULL, &len), -FI_ETOOSMALL);
	EXPECT(len, sizeof(struct sockaddr_in));
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	TRUE(m.addr.sin_family == AF_INET && m.addr.sin_port != 0);
	size_t cm_size = 0, optlen = sizeof cm_size;
	OK(fi_getopt(&m.pep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &cm_size, &optlen));
	TRUE(cm_size >= 5);

	connect_pair(&m, &s, &c, NULL);
	struct sockaddr_in peer;
	len = sizeof peer;
	OK(fi_getpeer(c.ep, &peer, &len));
	TRUE(peer.sin_port == m.addr.sin_port);

	/* send / recv, every byte checked */
	uint8_t *rx = m.buf, *tx = m.buf + 32768;
	send_checked(&m, &s, &c, 4096, 1);

	/* senddata: remote CQ data arrives with FI_REMOTE_CQ_DATA */
	fill(tx, 100, 2);
	OK(fi_recv(s.ep, rx, 8192, m.desc, 0, &ctx[2]));
	OK(fi_senddata(c.ep, tx, 100, m.desc, 0xabcd, 0, &ctx[3]));
	cq_expect(c.cq, &ctx[3], FI_SEND, 0, NULL);
	cq_expect(s.cq, &ctx[2], FI_RECV, 100, &e);
	TRUE((e.flags & FI_REMOTE_CQ_DATA) && e.data == 0xabcd);
	check(rx, 100, 2);

	/* inject: the buffer is reusable at once and no completion is written */
	uint8_t small[16];
	fill(small, sizeof small, 3);
	OK(fi_recv(s.ep, rx, 8192, m.desc, 0, &ctx[4]));
	OK(fi_inject(c.ep, small, sizeof small, 0));
	memset(small, 0, sizeof small);
	cq_expect(s.cq, &ctx[4], FI_RECV, 16, NULL);
	check(rx, 16, 3);
	EXPECT(fi_cq_read(c.cq, &e, 1), -FI_EAGAIN);
	/* injectdata */
	OK(fi_recv(s.ep, rx, 8192, m.desc, 0, &ctx[5]));
	OK(fi_injectdata(c.ep, tx, 8, 77, 0));
	cq_expect(s.cq, &ctx[5], FI_RECV, 8, &e);
	TRUE(e.data == 77);

	/* sendv / recvv over two ranges each */
	{
		struct iovec siov[2] = {{tx, 10}, {tx + 100, 20}}, riov[2] = {{rx, 15}, {rx + 64, 15}};
		void *d2[2] = {m.desc, m.desc};
		fill(tx, 200, 4);
		OK(fi_recvv(s.ep, riov, d2, 2, 0, &ctx[6]));
		OK(fi_sendv(c.ep, siov, d2, 2, 0, &ctx[7]));
		cq_expect(c.cq, &ctx[7], FI_SEND, 0, NULL);
		cq_expect(s.cq, &ctx[6], FI_RECV, 30, NULL);
		TRUE(memcmp(rx, tx, 10) == 0 && memcmp(rx + 10, tx + 100, 5) == 0 &&
		     memcmp(rx + 64, tx + 105, 15) == 0);
	}

	/* multi-recv: three messages packed into one buffer, which is released with
	 * FI_MULTI_RECV once less than the minimum is left */
	{
		size_t min = 300;
		OK(fi_setopt(&s.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &min, sizeof min));
		struct iovec iov = {rx, 1024};
		void *d = m.desc;
		struct fi_msg msg = {.msg_iov = &iov, .desc = &d, .iov_count = 1, .context = &ctx[8]};
		OK(fi_recvmsg(s.ep, &msg, FI_MULTI_RECV));
		/* Each receive completion, read by polling the CQ, reposts the rest of the buffer;
		 * until then the next message waits in the sender's RNR retries. */
		int got = 0, released = 0;
		for (int i = 0; i < 3; i++) {
			fill(tx + i * 300, 300, (uint8_t)(10 + i));
			OK(fi_send(c.ep, tx + i * 300, 300, m.desc, 0, &ctx[9]));
			while (got == i || (i == 2 && !released)) {
				EXPECT(cq_wait(s.cq, &e), 1);
				TRUE(e.op_context == &ctx[8]);
				if (e.len) {
					TRUE(e.len == 300 && e.buf == rx + got * 300);
					check(e.buf, 300, (uint8_t)(10 + got));
					got++;
				}
				released = !!(e.flags & FI_MULTI_RECV);
				TRUE(!released || got == 3);
			}
			cq_expect(c.cq, &ctx[9], FI_SEND, 0, NULL);
		}
		EXPECT(got, 3);
	}

	/* A region that a multi-receive buffer still uses is not closed under the device:
	 * -FI_EBUSY until the buffer is released (issue 15, finding 6). */
	{
		struct fid_mr *mr2;
		OK(fi_mr_reg(m.domain, rx, 1024, FI_RECV, 0, 0, 0, &mr2, NULL));
		void *d = fi_mr_desc(mr2);
		struct iovec iov = {rx, 400};
		struct fi_msg msg = {.msg_iov = &iov, .desc = &d, .iov_count = 1, .context = &ctx[8]};
		OK(fi_recvmsg(s.ep, &msg, FI_MULTI_RECV)); /* the minimum is still 300 */
		EXPECT(fi_close(&mr2->fid), -FI_EBUSY);
		fill(tx, 200, 3);
		OK(fi_send(c.ep, tx, 200, m.desc, 0, &ctx[9]));
		int released = 0, got = 0;
		while (!released) {
			EXPECT(cq_wait(s.cq, &e), 1);
			TRUE(e.op_context == &ctx[8]);
			got += e.len == 200;
			released = !!(e.flags & FI_MULTI_RECV);
		}
		EXPECT(got, 1);
		check(rx, 200, 3);
		cq_expect(c.cq, &ctx[9], FI_SEND, 0, NULL);
		EXPECT(fi_close(&mr2->fid), 0);
	}

	/* multi-receive posted with plain fi_recv on an endpoint whose rx_attr.op_flags hold
	 * FI_MULTI_RECV (as fabtests' multi_recv does), in both formats that carry buf: each
	 * completion says where its message landed; the last one releases the buffer */
	{
		enum fi_cq_format formats[] = {FI_CQ_FORMAT_DATA, FI_CQ_FORMAT_TAGGED};
		for (int f = 0; f < 2; f++) {
			struct side s3 = {0}, c3 = {0};
			size_t min = 300;
			pair_format = formats[f];
			pair_rx_op_flags = FI_MULTI_RECV;
			connect_pair(&m, &s3, &c3, NULL);
			pair_format = FI_CQ_FORMAT_DATA;
			pair_rx_op_flags = 0;
			OK(fi_setopt(&s3.ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &min, sizeof min));
			OK(fi_recv(s3.ep, rx, 1024, m.desc, 0, &ctx[13]));
			for (int i = 0; i < 3; i++) {
				struct fi_cq_tagged_entry t;
				fill(tx + i * 300, 300, (uint8_t)(20 + i));
				OK(fi_send(c3.ep, tx + i * 300, 300, m.desc, 0, &ctx[14]));
				time_t end = time(NULL) + 10;
				long r;
				while ((r = fi_cq_read(s3.cq, &t, 1)) == -FI_EAGAIN)
					TRUE(time(NULL) <= end);
				EXPECT(r, 1);
				/* fi_cq_data_entry is the head of fi_cq_tagged_entry */
				TRUE(t.op_context == &ctx[13] && t.len == 300);
				TRUE(t.buf == rx + i * 300);
				check(t.buf, 300, (uint8_t)(20 + i));
				TRUE(!!(t.flags & FI_MULTI_RECV) == (i == 2));
				while ((r = fi_cq_read(c3.cq, &t, 1)) == -FI_EAGAIN)
					TRUE(time(NULL) <= end);
				EXPECT(r, 1);
			}
			close_side(&c3, 1);
			close_side(&s3, 0);
		}
	}

	/* fi_srx_context with the info's own rx attributes */
	{
		struct fid_ep *srx;
		OK(fi_srx_context(m.domain, m.info->rx_attr, &srx, NULL));
		EXPECT(fi_close(&srx->fid), 0);
	}

	/* a shared receive context behind a second connection */
	{
		struct fi_rx_attr ra = {.size = 16, .iov_limit = 1};
		struct fid_ep *srx;
		OK(fi_srx_context(m.domain, &ra, &srx, NULL));
		connect_pair(&m, &s2, &c2, srx);
		fill(tx, 500, 5);
		OK(fi_recv(srx, rx, 8192, m.desc, 0, &ctx[10]));
		EXPECT(fi_recv(s2.ep, rx, 8192, m.desc, 0, &ctx[10]), -FI_EOPBADSTATE);
		OK(fi_send(c2.ep, tx, 500, m.desc, 0, &ctx[11]));
		cq_expect(c2.cq, &ctx[11], FI_SEND, 0, NULL);
		cq_expect(s2.cq, &ctx[10], FI_RECV, 500, NULL);
		check(rx, 500, 5);

		/* Calls that name no memory need no descriptor under FI_MR_LOCAL (fabtests'
		 * fi_shared_ctx posts them on MSG endpoints, as libfabric's verbs provider takes
		 * them): sends and receives of no bytes, and a receive with a NULL buffer, which
		 * takes a message of no bytes. */
		{
			struct fi_msg rnone = {.iov_count = 0, .context = &ctx[13]};
			struct fi_msg snone = {.iov_count = 0, .context = &ctx[15]};
			struct fi_cq_data_entry d;
			OK(fi_recv(srx, NULL, 64, NULL, 0, &ctx[12]));
			OK(fi_recvmsg(srx, &rnone, 0));
			OK(fi_recv(srx, rx, 0, NULL, 0, &ctx[6]));
			OK(fi_send(c2.ep, NULL, 0, NULL, 0, &ctx[14]));
			OK(fi_sendmsg(c2.ep, &snone, FI_COMPLETION));
			OK(fi_senddata(c2.ep, tx, 0, NULL, 0x5a, 0, &ctx[7]));
			cq_expect(c2.cq, &ctx[14], FI_SEND, 0, NULL);
			cq_expect(c2.cq, &ctx[15], FI_SEND, 0, NULL);
			cq_expect(c2.cq, &ctx[7], FI_SEND, 0, NULL);
			cq_expect(s2.cq, &ctx[12], FI_RECV, 0, NULL);
			cq_expect(s2.cq, &ctx[13], FI_RECV, 0, NULL);
			cq_expect(s2.cq, &ctx[6], FI_RECV, 0, &d);
			TRUE((d.flags & FI_REMOTE_CQ_DATA) && d.data == 0x5a);
			/* Still refused: bytes with no descriptor to find them by. */
			EXPECT(fi_send(c2.ep, tx, 8, NULL, 0, NULL), -FI_EINVAL);
			EXPECT(fi_recv(srx, rx, 8, NULL, 0, NULL), -FI_EINVAL);
			struct iovec one = {tx, 8};
			struct fi_msg bytes = {.msg_iov = &one, .iov_count = 1};
			EXPECT(fi_sendmsg(c2.ep, &bytes, 0), -FI_EINVAL);
			/* A message with bytes reaching a receive with no buffer: an error
			 * completion with its context, nothing delivered silently (FI_ETRUNC where
			 * the device says length error; rxe calls it a QP operation error, FI_EIO);
			 * on RC the connection breaks, so the sender's send fails too. */
			OK(fi_recv(srx, NULL, 64, NULL, 0, &ctx[12]));
			fill(tx, 8, 9);
			OK(fi_send(c2.ep, tx, 8, m.desc, 0, &ctx[14]));
			EXPECT(cq_wait(s2.cq, &d), -FI_EAVAIL);
			struct fi_cq_err_entry err = {0};
			EXPECT(fi_cq_readerr(s2.cq, &err, 0), 1);
			TRUE(err.op_context == &ctx[12] && (err.flags & FI_RECV));
			TRUE(err.err == FI_ETRUNC || err.err == FI_EIO);
			EXPECT(cq_wait(c2.cq, &d), -FI_EAVAIL);
			EXPECT(fi_cq_readerr(c2.cq, &err, 0), 1);
			TRUE(err.op_context == &ctx[14] && (err.flags & FI_SEND));
		}
		EXPECT(fi_close(&srx->fid), -FI_EBUSY);
		OK(fi_shutdown(c2.ep, 0));
		close_side(&c2, 1);
		close_side(&s2, 0);
		EXPECT(fi_close(&srx->fid), 0);
	}

	/* a receive flushed by shutdown is an error entry with its context */
	{
		OK(fi_recv(c.ep, rx, 64, m.desc, 0, &ctx[12]));
		OK(fi_shutdown(c.ep, 0));
		EXPECT(cq_wait(c.cq, &e), -FI_EAVAIL);
		struct fi_cq_err_entry err = {0};
		EXPECT(fi_cq_readerr(c.cq, &err, 0), 1);
		TRUE(err.op_context == &ctx[12] && (err.flags & FI_RECV));
		EXPECT(err.err, FI_ECANCELED);
		TRUE(fi_cq_strerror(c.cq, err.prov_errno, err.err_data, NULL, 0) != NULL);
		char text[64];
		TRUE(fi_cq_strerror(c.cq, err.prov_errno, err.err_data, text, sizeof text) == text);
		EXPECT(fi_cq_readerr(c.cq, &err, 0), -FI_EAGAIN);

		/* The server sees FI_SHUTDOWN; a buffer too small for it leaves it queued. */
		uint32_t ev;
		struct fi_eq_cm_entry cm;
		EXPECT(fi_eq_sread(m.peq, &ev, &cm, sizeof cm, 10000, FI_PEEK), sizeof cm);
		EXPECT(ev, FI_SHUTDOWN);
		EXPECT(fi_eq_read(m.peq, &ev, &cm, 4, 0), -FI_ETOOSMALL);
		EXPECT(fi_eq_read(m.peq, &ev, &cm, sizeof cm, 0), sizeof cm);
		EXPECT(ev, FI_SHUTDOWN);
		TRUE(cm.fid == &s.ep->fid);
		EXPECT(fi_eq_read(m.peq, &ev, &cm, sizeof cm, 0), -FI_EAGAIN);

		/* The side that shut down gets FI_SHUTDOWN too, once, as with libfabric's verbs
		 * provider: an application that calls fi_shutdown and waits does not hang. */
		EXPECT(fi_eq_sread(c.eq, &ev, &cm, sizeof cm, 10000, 0), sizeof cm);
		EXPECT(ev, FI_SHUTDOWN);
		TRUE(cm.fid == &c.ep->fid);
		EXPECT(fi_eq_read(c.eq, &ev, &cm, sizeof cm, 0), -FI_EAGAIN);
	}

	/* closing in use is refused; then everything closes in order */
	EXPECT(fi_close(&m.domain->fid), -FI_EBUSY);
	EXPECT(fi_close(&s.cq->fid), -FI_EBUSY);
	EXPECT(fi_close(&m.fabric->fid), -FI_EBUSY);
	close_side(&c, 1);
	close_side(&s, 0);
	msg_env_close(&m);
	fi_freeinfo(h);
	printf("ok msg\n");
}

static void avset_check(struct fid_domain *domain, struct fid_av *av, fi_addr_t *addrs,
			struct fid_ep *ep);
static struct fid_peer_av *off_owner_av;

/* An active endpoint takes the address of the passive endpoint its info's handle names
 * (fi_endpoint(3)), as fabtests' fi_msg_sockets has it: fi_getinfo echoes the handle, the
 * address is given once, it stays the endpoint's once the passive endpoint is closed, and
 * the server sees the connection come from it. */
static void pep_address_section(void)
{
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC};
	struct msg_env m = {0};
	struct side s = {0}, c = {0};
	struct fi_info *h = hints_for(FI_EP_MSG), *ci, *pi;
	struct fid_pep *cpep;
	struct fid_ep *ep2 = NULL;
	struct sockaddr_in want, got;
	size_t len;

	msg_env_open(&m, h);
	len = sizeof m.addr;
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	TRUE(m.info->src_addr && m.info->src_addrlen == sizeof want);
	memcpy(&want, m.info->src_addr, sizeof want);
	want.sin_port = 0;
	pi = fi_dupinfo(m.info);
	OK(fi_passive_ep(m.fabric, pi, &cpep, NULL));
	OK(fi_setname(&cpep->fid, &want, sizeof want));
	len = sizeof want;
	OK(fi_getname(&cpep->fid, &want, &len));
	TRUE(want.sin_port != 0 && want.sin_port != m.addr.sin_port);

	h->addr_format = FI_SOCKADDR_IN;
	h->dest_addr = malloc(sizeof m.addr);
	memcpy(h->dest_addr, &m.addr, sizeof m.addr);
	h->dest_addrlen = sizeof m.addr;
	h->handle = &cpep->fid;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &ci));
	TRUE(ci->handle == &cpep->fid);
	OK(fi_endpoint(m.domain, ci, &c.ep, &c));
	EXPECT(fi_endpoint(m.domain, ci, &ep2, NULL), -FI_EINVAL); /* given once */
	TRUE(ep2 == NULL);
	len = sizeof got;
	OK(fi_getname(&c.ep->fid, &got, &len));
	TRUE(got.sin_port == want.sin_port && got.sin_addr.s_addr == want.sin_addr.s_addr);
	OK(fi_close(&cpep->fid));

	OK(fi_eq_open(m.fabric, &ea, &c.eq, NULL));
	open_cq(m.domain, &c.cq);
	OK(fi_ep_bind(c.ep, &c.eq->fid, 0));
	OK(fi_ep_bind(c.ep, &c.cq->fid, FI_TRANSMIT | FI_RECV));
	OK(fi_enable(c.ep));
	OK(fi_connect(c.ep, &m.addr, "hello", 5));
	accept_request(&m, &s, &c, NULL);
	len = sizeof got;
	OK(fi_getpeer(s.ep, &got, &len));
	TRUE(got.sin_port == want.sin_port && got.sin_addr.s_addr == want.sin_addr.s_addr);
	len = sizeof got;
	OK(fi_getname(&c.ep->fid, &got, &len));
	TRUE(got.sin_port == want.sin_port);

	send_checked(&m, &s, &c, 1000, 7);

	close_side(&c, 1);
	close_side(&s, 0);
	fi_freeinfo(ci);
	fi_freeinfo(pi);
	h->handle = NULL;
	fi_freeinfo(h);
	msg_env_close(&m);
	printf("ok pep-address\n");
}

/* rxe frees a receive queue slot when its message lands, not when the completion is read:
 * a server that keeps posting receives and never reads its CQ overruns the device queue,
 * which drops what does not fit. fi_cq_read returns what the CQ kept, then -FI_EOVERRUN
 * (fi_cq(3)), and keeps saying so: posted, kept and dropped are counted. */
static void cq_overrun_section(void)
{
	struct msg_env m = {0};
	struct side s = {0}, c = {0};
	struct fi_info *h = hints_for(FI_EP_MSG);
	struct fi_cq_data_entry e[16];
	uint8_t *rx = NULL, *tx = NULL;
	long posted = 0, sent = 0, kept = 0, r = 0;
	int stop = 0, ctx = 0;
	size_t len;
	time_t end;

	msg_env_open(&m, h);
	rx = m.buf;
	tx = m.buf + 4096;
	len = sizeof m.addr;
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	connect_pair(&m, &s, &c, NULL);
	end = time(NULL) + 60;
	/* Rounds: the server fills its receive queue, the client sends as many, they land. */
	while (!stop && posted < 4 * (long)m.info->rx_attr->size && time(NULL) < end) {
		long round = 0, left;
		time_t last = time(NULL);
		while ((r = fi_recv(s.ep, rx, 64, m.desc, 0, &ctx)) == 0)
			round++;
		EXPECT(r, -FI_EAGAIN);
		posted += round;
		for (left = round; left > 0 && !stop;) {
			r = fi_send(c.ep, tx, 8, m.desc, 0, &ctx);
			if (r == 0) {
				left--;
				sent++;
				last = time(NULL);
			} else {
				EXPECT(r, -FI_EAGAIN);
				stop = time(NULL) > last + 3; /* the server's queue pair broke */
			}
			r = fi_cq_read(c.cq, e, 16);
			stop |= r == -FI_EAVAIL;
		}
		usleep(200000);
	}
	TRUE(posted > (long)m.info->rx_attr->size);
	end = time(NULL) + 30;
	for (;;) {
		r = fi_cq_read(s.cq, e, 16);
		if (r > 0) {
			kept += r;
		} else if (r == -FI_EAVAIL) {
			struct fi_cq_err_entry err = {0};
			OK(fi_cq_readerr(s.cq, &err, 0));
		} else if (r != -FI_EAGAIN || time(NULL) > end) {
			break;
		}
	}
	if (r != -FI_EOVERRUN)
		FAIL("%ld of %ld receives completed, then %ld (%s)", kept, sent, r,
		     fi_strerror((int)-r));
	TRUE(kept < sent);
	EXPECT(fi_cq_read(s.cq, e, 16), -FI_EOVERRUN); /* it stays overrun */
	close_side(&c, 1);
	close_side(&s, 0);
	msg_env_close(&m);
	fi_freeinfo(h);
	printf("ok cq-overrun (%ld posted, %ld sent, %ld kept, then -FI_EOVERRUN)\n", posted, sent,
	       kept);
}

static void dgram_section(void)
{
	struct fi_info *h = hints_for(FI_EP_DGRAM), *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cqa, *cqb;
	struct fid_ep *a, *b;
	struct fid_mr *mr;
	struct fi_cq_data_entry e;
	int ctx[8];

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE(info->ep_attr->type == FI_EP_DGRAM && info->addr_format == FI_ADDR_IB_UD);
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	struct fi_av_attr aa = {.type = FI_AV_TABLE};
	OK(fi_av_open(domain, &aa, &av, NULL));
	open_cq(domain, &cqa);
	open_cq(domain, &cqb);
	EXPECT(fi_endpoint(domain, info, &a, NULL), 0);
	OK(fi_endpoint(domain, info, &b, NULL));
	/* No AV yet: enable is refused with -FI_ENOAV. */
	OK(fi_ep_bind(a, &cqa->fid, FI_TRANSMIT | FI_RECV));
	EXPECT(fi_enable(a), -FI_ENOAV);
	OK(fi_ep_bind(a, &av->fid, 0));
	OK(fi_ep_bind(b, &av->fid, 0));
	OK(fi_ep_bind(b, &cqb->fid, FI_TRANSMIT | FI_RECV));
	OK(fi_enable(a));
	OK(fi_enable(b));

	uint8_t names[2][64];
	size_t len = 0;
	EXPECT(fi_getname(&a->fid, NULL, &len), -FI_ETOOSMALL);
	TRUE(len > 0 && len <= 64);
	size_t name_len = len;
	OK(fi_getname(&a->fid, names[0], &len));
	len = sizeof names[1];
	OK(fi_getname(&b->fid, names[1], &len));
	EXPECT(len, name_len);
	fi_addr_t addrs[2];
	uint8_t packed[128];
	memcpy(packed, names[0], name_len);
	memcpy(packed + name_len, names[1], name_len);
	EXPECT(fi_av_insert(av, packed, 2, addrs, 0, NULL), 2);
	uint8_t back[64];
	len = sizeof back;
	OK(fi_av_lookup(av, addrs[1], back, &len));
	TRUE(len == name_len && memcmp(back, names[1], len) == 0);
	char str[128];
	len = sizeof str;
	TRUE(fi_av_straddr(av, names[1], str, &len) == str);
	TRUE(strncmp(str, "fi_addr_ib_ud://", 16) == 0);
	avset_check(domain, av, addrs, a);

	uint8_t *buf = aligned_alloc(4096, BUF), *rx = buf, *tx = buf + 32768;
	OK(fi_mr_reg(domain, buf, BUF, FI_SEND | FI_RECV, 0, 0, 0, &mr, NULL));
	void *desc = fi_mr_desc(mr);
	fill(tx, 512, 6);
	OK(fi_recv(b, rx, info->ep_attr->max_msg_size, desc, 0, &ctx[0]));
	OK(fi_send(a, tx, 512, desc, addrs[1], &ctx[1]));
	cq_expect(cqa, &ctx[1], FI_SEND, 0, NULL);
	cq_expect(cqb, &ctx[0], FI_RECV, 512, NULL);
	check(rx, 512, 6);

	OK(fi_recv(b, rx, info->ep_attr->max_msg_size, desc, 0, &ctx[2]));
	OK(fi_senddata(a, tx, 64, desc, 4242, addrs[1], &ctx[3]));
	cq_expect(cqa, &ctx[3], FI_SEND, 0, NULL);
	cq_expect(cqb, &ctx[2], FI_RECV, 64, &e);
	TRUE((e.flags & FI_REMOTE_CQ_DATA) && e.data == 4242);

	uint8_t small[8];
	fill(small, sizeof small, 7);
	OK(fi_recv(b, rx, info->ep_attr->max_msg_size, desc, 0, &ctx[4]));
	OK(fi_inject(a, small, sizeof small, addrs[1]));
	cq_expect(cqb, &ctx[4], FI_RECV, 8, NULL);
	check(rx, 8, 7);

	/* bad calls on a datagram endpoint */
	EXPECT(fi_send(a, tx, 8, desc, 99, &ctx[5]), -FI_EINVAL);
	EXPECT(fi_send(a, tx, info->ep_attr->max_msg_size + 1, desc, addrs[1], &ctx[5]),
	       -FI_EMSGSIZE);
	EXPECT(fi_connect(a, names[1], NULL, 0), -FI_EINVAL);
	EXPECT(fi_av_remove(av, &addrs[0], 1, 0), 0);
	EXPECT(fi_send(b, tx, 8, desc, addrs[0], &ctx[5]), -FI_EINVAL);

	EXPECT(fi_close(&av->fid), -FI_EBUSY);
	EXPECT(fi_close(&a->fid), 0);
	EXPECT(fi_close(&b->fid), 0);
	EXPECT(fi_close(&mr->fid), 0);
	EXPECT(fi_close(&av->fid), 0);
	/* The peer's fid_peer_av outlives the owner's AV as a closed handle: a peer that asks
	 * after the owner closed gets -FI_EINVAL, not freed memory (issue 15, finding 1). */
	{
		struct fi_av_attr q = {0};
		EXPECT(off_owner_av->owner_ops->query(off_owner_av, &q), -FI_EINVAL);
		EXPECT(off_owner_av->owner_ops->ep_addr(off_owner_av, a), FI_ADDR_NOTAVAIL);
	}
	EXPECT(fi_close(&cqa->fid), 0);
	EXPECT(fi_close(&cqb->fid), 0);
	EXPECT(fi_close(&domain->fid), 0);
	EXPECT(fi_close(&fabric->fid), 0);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(buf);
	printf("ok dgram\n");
}

/* Calls that must fail with the error the man pages give, and not crash. */
static void bad_section(void)
{
	struct fi_info *h = hints_for(FI_EP_MSG), *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq;
	struct fid_mr *mr;
	struct fid_ep *ep;
	struct fid_eq *eq;
	struct fid_cntr *cntr;
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC};
	uint8_t buf[256];

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	OK(fi_eq_open(fabric, &ea, &eq, NULL));
	open_cq(domain, &cq);
	OK(fi_mr_reg(domain, buf, sizeof buf, FI_SEND | FI_RECV, 0, 0, 0, &mr, NULL));

	/* NULL and malformed arguments */
	EXPECT(fi_cq_open(domain, NULL, &cq, NULL), -FI_EINVAL);
	EXPECT(fi_mr_reg(domain, buf, sizeof buf, FI_SEND, 0, 0, 0, NULL, NULL), -FI_EINVAL);
	EXPECT(fi_mr_reg(domain, buf, sizeof buf, 1ULL << 40, 0, 0, 0, &mr, NULL), -FI_EINVAL);
	EXPECT(fi_cq_read(cq, NULL, 1), -FI_EINVAL);
	long r0 = fi_cq_read(cq, buf, 0); /* drives progress only */
	TRUE(r0 == 0 || r0 == -FI_EAGAIN);
	EXPECT(fi_cq_readerr(cq, NULL, 0), -FI_EINVAL);
	struct fi_cq_err_entry err = {0};
	EXPECT(fi_cq_readerr(cq, &err, 0), -FI_EAGAIN);
	EXPECT(fi_cq_sread(cq, buf, 1, NULL, 0), -FI_EINVAL); /* FI_WAIT_NONE: no blocking */
	EXPECT(fi_domain(fabric, NULL, &domain, NULL), -FI_EINVAL);
	EXPECT(fi_cntr_open(domain, NULL, NULL, NULL), -FI_EINVAL);
	{
		struct fi_cntr_attr set = {.wait_obj = FI_WAIT_SET}; /* no wait_set */
		EXPECT(fi_cntr_open(domain, &set, &cntr, NULL), -FI_EINVAL);
		set.wait_obj = FI_WAIT_POLLFD;
		EXPECT(fi_cntr_open(domain, &set, &cntr, NULL), -FI_ENOSYS);
	}
	EXPECT(fi_open_ops(&domain->fid, "nothing", 0, NULL, NULL), -FI_ENOSYS);
	/* Sizes from C that no allocation holds: an error, never an aborted process. */
	{
		struct fi_av_attr big = {.type = FI_AV_TABLE, .count = 1ULL << 40};
		struct fi_av_attr many = {.type = FI_AV_MAP, .count = 1ULL << 31};
		struct fid_av *av;
		EXPECT(fi_av_open(domain, &big, &av, NULL), -FI_EINVAL);
		OK(fi_av_open(domain, &many, &av, NULL)); /* an estimate: not allocated up front */
		struct fi_av_set_attr sa = {.count = 1ULL << 40, .start_addr = 0, .end_addr = 0,
					    .stride = 1};
		struct fid_av_set *set;
		EXPECT(fi_av_set(av, &sa, &set, NULL), -FI_EINVAL); /* address 0 is not in the AV */
		EXPECT(fi_close(&av->fid), 0);
		struct fi_rx_attr ra = {.caps = FI_MSG | FI_TAGGED | FI_RECV, .size = (1U << 31) - 1};
		struct fid_ep *srx;
		EXPECT(fi_srx_context(domain, &ra, &srx, NULL), -FI_EINVAL);
		EXPECT(fi_eq_write(eq, FI_NOTIFY, buf, 1ULL << 40, 0), -FI_EINVAL);
		EXPECT(fi_eq_write(eq, FI_NOTIFY, buf, SIZE_MAX, 0), -FI_EINVAL);
		struct fi_cq_data_entry one;
		EXPECT(fi_cq_read(cq, &one, SIZE_MAX / 8), -FI_EINVAL);
		struct fi_cq_err_entry ee = {.err_data = buf, .err_data_size = SIZE_MAX};
		EXPECT(fi_cq_readerr(cq, &ee, 0), -FI_EINVAL);
	}
	/* rverbs owns peer objects; its own are never opened as another's peer (fi_peer(3)) */
	{
		struct fi_cq_attr pa = {.format = FI_CQ_FORMAT_DATA, .flags = FI_PEER};
		struct fid_cq *pcq;
		EXPECT(fi_cq_open(domain, &pa, &pcq, NULL), -FI_EINVAL);
		struct fi_rx_attr ra = {.size = 4, .op_flags = FI_PEER};
		struct fid_ep *psrx;
		EXPECT(fi_srx_context(domain, &ra, &psrx, NULL), -FI_EINVAL);
		struct fid_domain *pd;
		EXPECT(fi_domain2(fabric, info, &pd, FI_PEER, NULL), -FI_EINVAL);
		struct fi_eq_attr pea = {.wait_obj = FI_WAIT_UNSPEC, .flags = FI_PEER};
		struct fid_eq *peq;
		EXPECT(fi_eq_open(fabric, &pea, &peq, NULL), -FI_EINVAL);
		struct fid_ep *pep2;
		EXPECT(fi_endpoint2(domain, info, &pep2, FI_PEER_TRANSFER, NULL), -FI_ENOSYS);
		struct fid *exported;
		EXPECT(fi_export_fid(&domain->fid, 0, &exported, NULL), -FI_ENOSYS);
	}

	/* an endpoint that is not enabled, and bad data calls */
	struct sockaddr_in self = *(struct sockaddr_in *)info->src_addr;
	self.sin_port = htons(9); /* nothing listens: the connect fails later, not here */
	info->dest_addr = malloc(sizeof self);
	memcpy(info->dest_addr, &self, sizeof self);
	info->dest_addrlen = sizeof self;
	OK(fi_endpoint(domain, info, &ep, NULL));
	EXPECT(fi_send(ep, buf, 8, fi_mr_desc(mr), 0, NULL), -FI_EOPBADSTATE);
	OK(fi_ep_bind(ep, &eq->fid, 0));
	OK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	EXPECT(fi_ep_bind(ep, &mr->fid, 0), -FI_EINVAL);
	OK(fi_enable(ep));
	EXPECT(fi_send(ep, buf, 8, NULL, 0, NULL), -FI_EINVAL);            /* no desc */
	EXPECT(fi_send(ep, buf, 8, (void *)cq, 0, NULL), -FI_EINVAL);      /* not a desc */
	EXPECT(fi_recv(ep, buf, 4096, fi_mr_desc(mr), 0, NULL), -FI_EINVAL); /* outside */
	EXPECT(fi_recv(ep, buf - 64, 8, fi_mr_desc(mr), 0, NULL), -FI_EINVAL);
	EXPECT(fi_inject(ep, buf, info->tx_attr->inject_size + 1, 0), -FI_EINVAL);
	EXPECT(fi_write(ep, buf, 8, fi_mr_desc(mr), 0, 0, 0, NULL), -FI_EOPNOTSUPP); /* no FI_RMA */
	EXPECT(fi_tsend(ep, buf, 8, fi_mr_desc(mr), 0, 1, NULL), -FI_ENOSYS);
	size_t v = 0, vl = sizeof v;
	EXPECT(fi_getopt(&ep->fid, 99, FI_OPT_CM_DATA_SIZE, &v, &vl), -FI_ENOPROTOOPT);
	vl = 1;
	EXPECT(fi_getopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, &vl), -FI_ETOOSMALL);
	EXPECT(vl, sizeof(size_t));
	EXPECT(fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &v, 1), -FI_EINVAL);
	EXPECT(fi_accept(ep, NULL, 0) < 0, 1);
	EXPECT(fi_listen((struct fid_pep *)ep), -FI_EINVAL);

	EXPECT(fi_close(&eq->fid), -FI_EBUSY);
	EXPECT(fi_close(&ep->fid), 0);
	EXPECT(fi_close(&mr->fid), 0);
	EXPECT(fi_close(&cq->fid), 0);
	EXPECT(fi_close(&eq->fid), 0);
	EXPECT(fi_close(&domain->fid), 0);
	EXPECT(fi_close(&fabric->fid), 0);
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok bad\n");
}

/* ---- handles: closed, reused, foreign and forged handles are -FI_EINVAL (issue 15) ---- */

static void handle_section(void)
{
	struct fi_info *h = hints_for(FI_EP_MSG), *info, *sh, *sinfo;
	struct fid_fabric *fabric, *sfab;
	struct fid_domain *domain, *sdom;
	struct fid_cq *cq, *old, *fresh, *scq;
	struct fid_av *sav;
	struct fid_mr *mr, *smr;
	struct fid_ep *ep;
	struct fid_eq *eq;
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC};
	struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
	struct fi_av_attr aa = {.type = FI_AV_TABLE};
	struct fi_cq_data_entry e;
	uint8_t buf[256];
	int i;

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	OK(fi_eq_open(fabric, &ea, &eq, NULL));
	open_cq(domain, &cq);
	OK(fi_mr_reg(domain, buf, sizeof buf, FI_SEND | FI_RECV, 0, 0, 0, &mr, NULL));

	/* A double close after the address could have been reused: the second close is
	 * -FI_EINVAL and the new objects stay open (before, it freed whichever object lived
	 * at that address). */
	for (i = 0; i < 64; i++) {
		OK(fi_cq_open(domain, &ca, &old, NULL));
		EXPECT(fi_close(&old->fid), 0);
		OK(fi_cq_open(domain, &ca, &fresh, NULL));
		TRUE(fresh != old); /* a closed handle's address is not handed out again */
		EXPECT(fi_close(&old->fid), -FI_EINVAL);
		EXPECT(fi_cq_read(old, &e, 1), -FI_EINVAL);
		EXPECT(fi_cq_read(fresh, &e, 1), -FI_EAGAIN);
		EXPECT(fi_close(&fresh->fid), 0);
		EXPECT(fi_close(&fresh->fid), -FI_EINVAL);
	}
	{
		struct fid_mr *m2;
		OK(fi_mr_reg(domain, buf, 64, FI_SEND, 0, 0, 0, &m2, NULL));
		void *stale = fi_mr_desc(m2);
		EXPECT(fi_close(&m2->fid), 0);
		EXPECT(fi_close(&m2->fid), -FI_EINVAL);
		struct sockaddr_in self = *(struct sockaddr_in *)info->src_addr;
		self.sin_port = htons(9);
		info->dest_addr = malloc(sizeof self);
		memcpy(info->dest_addr, &self, sizeof self);
		info->dest_addrlen = sizeof self;
		OK(fi_endpoint(domain, info, &ep, NULL));
		OK(fi_ep_bind(ep, &eq->fid, 0));
		OK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
		OK(fi_enable(ep));
		/* A descriptor of a closed region, and plain data that starts like a region. */
		EXPECT(fi_send(ep, buf, 8, stale, 0, NULL), -FI_EINVAL);
		uint64_t forged[16] = {FI_CLASS_MR, 0, 0, (uint64_t)(uintptr_t)buf, sizeof buf};
		EXPECT(fi_send(ep, buf, 8, forged, 0, NULL), -FI_EINVAL);
		EXPECT(fi_recv(ep, buf, 8, forged, 0, NULL), -FI_EINVAL);
		/* Another rverbs object of the wrong class where a region is expected. */
		EXPECT(fi_send(ep, buf, 8, eq, 0, NULL), -FI_EINVAL);
	}

	/* shm's objects (same process, same classes) handed to rverbs. */
	sh = fi_allocinfo();
	sh->ep_attr->type = FI_EP_RDM;
	sh->caps = FI_MSG;
	sh->fabric_attr->prov_name = strdup("shm");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, sh, &sinfo));
	OK(fi_fabric(sinfo->fabric_attr, &sfab, NULL));
	OK(fi_domain(sfab, sinfo, &sdom, NULL));
	OK(fi_cq_open(sdom, &ca, &scq, NULL));
	OK(fi_av_open(sdom, &aa, &sav, NULL));
	OK(fi_mr_reg(sdom, buf, sizeof buf, FI_SEND | FI_RECV, 0, 0, 0, &smr, NULL));
	{
		struct fid_ep *ep2;
		struct fi_rverbs_peer_ops *ops;
		struct fid_av *pav;
		OK(fi_endpoint(domain, info, &ep2, NULL));
		EXPECT(fi_ep_bind(ep2, &scq->fid, FI_TRANSMIT | FI_RECV), -FI_EINVAL);
		EXPECT(fi_ep_bind(ep2, &sav->fid, 0), -FI_EINVAL);
		EXPECT(fi_close(&ep2->fid), 0);
		EXPECT(fi_send(ep, buf, 8, fi_mr_desc(smr), 0, NULL), -FI_EINVAL);
		EXPECT(fi_send(ep, buf, 8, smr, 0, NULL), -FI_EINVAL);
		OK(fi_open_ops(&domain->fid, FI_RVERBS_PEER_OPS, 0, (void **)&ops, NULL));
		EXPECT(ops->open_peer_av(sav, sdom, NULL, &pav), -FI_EINVAL);
		EXPECT(ops->open_peer_domain(sdom, sfab, sinfo, &sdom), -FI_EINVAL);
		EXPECT(ops->import_shm((struct fid_ep *)scq, (struct fid **)&pav), -FI_EINVAL);
	}
	/* shm's objects are untouched: they still work and close. */
	EXPECT(fi_cq_read(scq, &e, 1), -FI_EAGAIN);
	EXPECT(fi_close(&smr->fid), 0);
	EXPECT(fi_close(&sav->fid), 0);
	EXPECT(fi_close(&scq->fid), 0);
	EXPECT(fi_close(&sdom->fid), 0);
	EXPECT(fi_close(&sfab->fid), 0);
	fi_freeinfo(sinfo);
	fi_freeinfo(sh);

	EXPECT(fi_close(&ep->fid), 0);
	EXPECT(fi_close(&ep->fid), -FI_EINVAL);
	EXPECT(fi_send(ep, buf, 8, fi_mr_desc(mr), 0, NULL), -FI_EINVAL);
	EXPECT(fi_close(&mr->fid), 0);
	EXPECT(fi_close(&cq->fid), 0);
	EXPECT(fi_close(&eq->fid), 0);
	EXPECT(fi_close(&eq->fid), -FI_EINVAL);
	EXPECT(fi_close(&domain->fid), 0);
	EXPECT(fi_close(&domain->fid), -FI_EINVAL);
	EXPECT(fi_close(&fabric->fid), 0);
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok handles\n");
}

/* ---- peer: libfabric's shm imported as a peer of rverbs' software SRX ---- */

/* What the shm sender sends, in order: untagged (tag 0) then tagged. */
static const struct {
	uint64_t tag;
	size_t len;
} shm_plan[] = {{0, 8}, {0, 65536}, {0, 1 << 20}, {7, 100}, {9, 5000}};
#define SHM_N (sizeof shm_plan / sizeof shm_plan[0])

/* The other process: a plain libfabric shm endpoint sending the plan to `name`. */
static void shm_send_section(const char *name)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fid_cq *cq;
	struct fid_ep *ep;
	struct fi_av_attr aa = {.type = FI_AV_TABLE};
	struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_NONE};
	struct fi_cq_tagged_entry e;
	fi_addr_t to;
	uint8_t *bufs[SHM_N];
	size_t done = 0;

	h->caps = FI_MSG | FI_TAGGED;
	h->ep_attr->type = FI_EP_RDM;
	h->domain_attr->av_type = FI_AV_TABLE;
	h->fabric_attr->prov_name = strdup("shm");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	OK(fi_av_open(domain, &aa, &av, NULL));
	OK(fi_cq_open(domain, &ca, &cq, NULL));
	OK(fi_endpoint(domain, info, &ep, NULL));
	OK(fi_ep_bind(ep, &av->fid, 0));
	OK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	OK(fi_enable(ep));
	EXPECT(fi_av_insert(av, name, 1, &to, 0, NULL), 1);
	for (size_t i = 0; i < SHM_N; i++) {
		time_t end = time(NULL) + 30;
		long r;
		bufs[i] = malloc(shm_plan[i].len);
		fill(bufs[i], shm_plan[i].len, (uint8_t)(i + 1));
		for (;;) {
			if (shm_plan[i].tag)
				r = fi_tsend(ep, bufs[i], shm_plan[i].len, NULL, to, shm_plan[i].tag, NULL);
			else
				r = fi_send(ep, bufs[i], shm_plan[i].len, NULL, to, NULL);
			if (r != -FI_EAGAIN)
				break;
			if (fi_cq_read(cq, &e, 1) == 1)
				done++;
			if (time(NULL) > end)
				FAIL("send %zu: EAGAIN for 30 s", i);
		}
		OK(r);
	}
	time_t end = time(NULL) + 60;
	while (done < SHM_N) {
		long r = fi_cq_read(cq, &e, 1);
		if (r == 1)
			done++;
		else if (r != -FI_EAGAIN)
			FAIL("shm send completion: %ld", r);
		if (time(NULL) > end)
			FAIL("%zu of %zu sends completed", done, SHM_N);
	}
	EXPECT(fi_close(&ep->fid), 0);
	EXPECT(fi_close(&cq->fid), 0);
	EXPECT(fi_close(&av->fid), 0);
	EXPECT(fi_close(&domain->fid), 0);
	EXPECT(fi_close(&fabric->fid), 0);
	for (size_t i = 0; i < SHM_N; i++)
		free(bufs[i]);
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok shm-send\n");
}

/* One completion of the rverbs CQ (tagged format) within 30 s. */
static void tcq_expect(struct fid_cq *cq, void *ctx, uint64_t flag, size_t len, uint64_t tag)
{
	struct fi_cq_tagged_entry e;
	time_t end = time(NULL) + 30;
	long r;
	while ((r = fi_cq_read(cq, &e, 1)) == -FI_EAGAIN)
		if (time(NULL) > end)
			FAIL("no completion for ctx %p within 30 s", ctx);
	if (r == -FI_EAVAIL) {
		struct fi_cq_err_entry err = {0};
		fi_cq_readerr(cq, &err, 0);
		FAIL("error completion %d (%s) for ctx %p", err.err, fi_strerror(err.err), err.op_context);
	}
	EXPECT(r, 1);
	if (e.op_context != ctx || !(e.flags & flag) || e.len != len || e.tag != tag)
		FAIL("completion ctx %p flags %#lx len %zu tag %lu; expected ctx %p flag %#lx len %zu tag %lu",
		     e.op_context, (unsigned long)e.flags, e.len, (unsigned long)e.tag, ctx,
		     (unsigned long)flag, len, (unsigned long)tag);
}

static void peer_section(const char *self)
{
	struct fi_info *h = hints_for(FI_EP_MSG), *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq;
	struct fid_ep *srx;
	struct fid *imp;
	struct fi_rverbs_peer_ops *ops;
	struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_NONE};
	struct fi_rx_attr ra = {.caps = FI_MSG | FI_TAGGED | FI_RECV, .size = 64};
	struct fi_cq_err_entry err = {0};
	char name[256];
	size_t len = sizeof name;
	uint8_t *bufs[SHM_N];
	int ctx[SHM_N + 2];
	void *bad;

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	EXPECT(fi_open_ops(&domain->fid, "no_such_ops", 0, &bad, NULL), -FI_ENOSYS);
	/* fi_import_fid: rverbs takes no user-owned objects (a memory monitor, say). */
	struct fid monitor = {.fclass = FI_CLASS_MEM_MONITOR};
	EXPECT(fi_import_fid(&domain->fid, &monitor, 0), -FI_ENOSYS);
	OK(fi_open_ops(&domain->fid, FI_RVERBS_PEER_OPS, 0, (void **)&ops, NULL));
	TRUE(ops->size == sizeof *ops);
	OK(fi_cq_open(domain, &ca, &cq, NULL));
	OK(fi_srx_context(domain, &ra, &srx, NULL));
	EXPECT(ops->import_shm(srx, &imp), -FI_EOPBADSTATE); /* no CQ bound yet */
	OK(fi_ep_bind(srx, &cq->fid, FI_RECV));
	OK(ops->import_shm(srx, &imp));
	OK(ops->import_name(imp, name, &len));
	TRUE(strncmp(name, "fi_shm://", 9) == 0 && len == strlen(name) + 1);

	/* The SRX's own completions: a cancelled receive, a peek that finds nothing. */
	uint8_t small[16];
	OK(fi_recv(srx, small, sizeof small, NULL, FI_ADDR_UNSPEC, &ctx[SHM_N]));
	OK(fi_cancel(&srx->fid, &ctx[SHM_N]));
	struct fi_cq_tagged_entry te;
	EXPECT(fi_cq_read(cq, &te, 1), -FI_EAVAIL);
	EXPECT(fi_cq_readerr(cq, &err, 0), 1);
	TRUE(err.op_context == &ctx[SHM_N] && err.err == FI_ECANCELED);
	EXPECT(fi_cancel(&srx->fid, &ctx[SHM_N]), -FI_ENOENT);

	/* The first message's receive is posted before the sender starts. */
	for (size_t i = 0; i < SHM_N; i++)
		bufs[i] = calloc(1, shm_plan[i].len);
	OK(fi_recv(srx, bufs[0], shm_plan[0].len, NULL, FI_ADDR_UNSPEC, &ctx[0]));
	pid_t child = fork();
	if (child == 0) {
		execl(self, self, "shm-send", name, (char *)NULL);
		_exit(127);
	}
	TRUE(child > 0);
	tcq_expect(cq, &ctx[0], FI_RECV | FI_MSG, shm_plan[0].len, 0);
	/* The others arrive before their receives; posted late, they still match. */
	for (size_t i = 1; i < 3; i++) {
		OK(fi_recv(srx, bufs[i], shm_plan[i].len, NULL, FI_ADDR_UNSPEC, &ctx[i]));
		tcq_expect(cq, &ctx[i], FI_RECV | FI_MSG, shm_plan[i].len, 0);
	}
	/* Tagged: peek until tag 9 waits (unexpected), then take 9 before 7. */
	struct fi_msg_tagged pm = {.addr = FI_ADDR_UNSPEC, .tag = 9, .context = &ctx[SHM_N + 1]};
	time_t end = time(NULL) + 30;
	for (;;) {
		struct fi_cq_tagged_entry e;
		long r;
		OK(fi_trecvmsg(srx, &pm, FI_PEEK));
		while ((r = fi_cq_read(cq, &e, 1)) == -FI_EAGAIN)
			;
		if (r == 1) {
			if (e.op_context != &ctx[SHM_N + 1] || e.tag != 9 || !(e.flags & FI_TAGGED))
				FAIL("peek: ctx %p tag %lu len %zu flags %#lx", e.op_context,
				     (unsigned long)e.tag, e.len, (unsigned long)e.flags);
			break;
		}
		EXPECT(r, -FI_EAVAIL);
		EXPECT(fi_cq_readerr(cq, &err, 0), 1);
		EXPECT(err.err, FI_ENOMSG);
		if (time(NULL) > end)
			FAIL("the tag-9 message never waited");
	}
	OK(fi_trecv(srx, bufs[4], shm_plan[4].len, NULL, FI_ADDR_UNSPEC, 9, 0, &ctx[4]));
	tcq_expect(cq, &ctx[4], FI_RECV | FI_TAGGED, shm_plan[4].len, 9);
	OK(fi_trecv(srx, bufs[3], shm_plan[3].len, NULL, FI_ADDR_UNSPEC, 7, 0, &ctx[3]));
	tcq_expect(cq, &ctx[3], FI_RECV | FI_TAGGED, shm_plan[3].len, 7);
	for (size_t i = 0; i < SHM_N; i++) {
		check(bufs[i], shm_plan[i].len, (uint8_t)(i + 1));
		free(bufs[i]);
	}
	int st;
	EXPECT(waitpid(child, &st, 0), child);
	TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);

	EXPECT(fi_close(&srx->fid), -FI_EBUSY); /* shm still shares it */
	EXPECT(fi_close(imp), 0);
	EXPECT(fi_close(&srx->fid), 0);
	EXPECT(fi_close(&cq->fid), 0);
	EXPECT(fi_close(&domain->fid), 0);
	EXPECT(fi_close(&fabric->fid), 0);
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok peer\n");
}

/* ---- transfer: FI_PEER_TRANSFER with an in-tree offload peer ---- */

#define ROUNDS 100

/* The offload peer's endpoint: it exchanges its own control messages over rverbs. */
struct offload_ep {
	struct fid_ep ep;
	struct fid_ep *xfer;       /* the owner's transfer endpoint */
	struct fid_cq *app_cq;     /* the application's CQ, which must see none of this */
	void *desc;                /* memory registered with the owner's domain */
	uint8_t *tx, *rx;
	int depth, max_depth;      /* callback nesting, to catch recursion */
	int sent, received, errors, closed, pinger;
	uint32_t last;
	int tagged;                /* its messages are tagged (fi_tsend/fi_trecv) */
	fi_addr_t dest;            /* where it sends (RDM), FI_ADDR_UNSPEC over MSG */
	fi_addr_t from;            /* the source its receive completions carry */
};

#define OFF_TAG 0x7e57

static int off_ep_close(struct fid *f)
{
	((struct offload_ep *)f)->closed++;
	return 0;
}

static struct fi_ops off_ep_fi_ops = {.size = sizeof(struct fi_ops), .close = off_ep_close};

static void off_send(struct offload_ep *o, uint32_t v)
{
	memcpy(o->tx, &v, sizeof v);
	if (o->tagged)
		OK(fi_tsend(o->xfer, o->tx, sizeof v, o->desc, o->dest, OFF_TAG, o->tx));
	else
		OK(fi_send(o->xfer, o->tx, sizeof v, o->desc, o->dest, o->tx));
}

static void off_recv(struct offload_ep *o, size_t len)
{
	if (o->tagged)
		OK(fi_trecv(o->xfer, o->rx, len, o->desc, FI_ADDR_UNSPEC, OFF_TAG, 0, o->rx));
	else
		OK(fi_recv(o->xfer, o->rx, len, o->desc, FI_ADDR_UNSPEC, o->rx));
}

static ssize_t off_complete(struct fid_ep *ep, struct fi_cq_tagged_entry *e, fi_addr_t *src)
{
	struct offload_ep *o = (struct offload_ep *)ep;
	struct fi_cq_tagged_entry app;
	TRUE(src && *src == ((e->flags & FI_RECV) ? o->from : FI_ADDR_NOTAVAIL));
	TRUE(!!(e->flags & FI_TAGGED) == !!o->tagged);
	if (++o->depth > o->max_depth)
		o->max_depth = o->depth;
	/* A read of the application's CQ from inside the callback: nothing for the app, and
	 * no recursive call back into this callback. */
	EXPECT(fi_cq_read(o->app_cq, &app, 1), -FI_EAGAIN);
	if (e->flags & FI_SEND) {
		TRUE(e->op_context == o->tx);
		o->sent++;
	} else {
		uint32_t v;
		if (!(e->flags & FI_RECV) || e->op_context != o->rx || e->len != sizeof v)
			FAIL("peer completion: ctx %p (rx %p tx %p) flags %#lx len %zu", e->op_context,
			     (void *)o->rx, (void *)o->tx, (unsigned long)e->flags, e->len);
		memcpy(&v, o->rx, sizeof v);
		TRUE(v == o->last + 1);
		o->last = v;
		o->received++;
		/* Posting again from the callback: the next receive, and the answer. */
		if (v < ROUNDS)
			off_recv(o, 64);
		if (!o->pinger)
			off_send(o, v);
		else if (v < ROUNDS)
			off_send(o, v + 1);
	}
	o->depth--;
	return 0;
}

static ssize_t off_comperr(struct fid_ep *ep, struct fi_cq_err_entry *e)
{
	struct offload_ep *o = (struct offload_ep *)ep;
	TRUE(e->err != 0);
	o->errors++;
	return 0;
}

static struct fi_ops_transfer_peer off_peer_ops = {
	.size = sizeof(struct fi_ops_transfer_peer),
	.complete = off_complete,
	.comperr = off_comperr,
};

static struct offload_ep *off_next; /* what the peer domain's endpoint2 hands out next */
static enum fi_ep_type off_ep_type = FI_EP_MSG; /* the owner's endpoint type it expects */

static int off_endpoint2(struct fid_domain *d, struct fi_info *info, struct fid_ep **ep,
			 uint64_t flags, void *context)
{
	struct fi_peer_transfer_context *ctx = context;
	(void)d;
	(void)info;
	if (flags != FI_PEER_TRANSFER || !ctx || ctx->size < sizeof *ctx || !ctx->ep)
		return -FI_EINVAL;
	TRUE(ctx->info && ctx->info->ep_attr->type == off_ep_type);
	off_next->xfer = ctx->ep;
	off_next->ep.fid.fclass = FI_CLASS_EP;
	off_next->ep.fid.ops = &off_ep_fi_ops;
	ctx->peer_ops = &off_peer_ops;
	*ep = &off_next->ep;
	return 0;
}

static struct fi_ops_domain off_domain_ops = {
	.size = sizeof(struct fi_ops_domain),
	.endpoint2 = off_endpoint2,
};
static struct fid_domain off_domain = {.fid = {.fclass = FI_CLASS_DOMAIN}, .ops = &off_domain_ops};

/* What the owner handed the offload peer: its domain and its EQ. */
static struct fid_domain *off_owner_domain;
static struct fid_eq *off_owner_eq;
static struct fid_eq off_eq = {.fid = {.fclass = FI_CLASS_EQ}};

static int off_domain2(struct fid_fabric *f, struct fi_info *info, struct fid_domain **d,
		       uint64_t flags, void *context)
{
	struct fi_peer_domain_context *ctx = context;
	(void)f;
	(void)info;
	if (flags != FI_PEER || !ctx || ctx->size < sizeof *ctx || !ctx->domain)
		return -FI_EINVAL;
	off_owner_domain = ctx->domain;
	*d = &off_domain;
	return 0;
}

static int off_eq_open(struct fid_fabric *f, struct fi_eq_attr *attr, struct fid_eq **eq,
		       void *context)
{
	struct fi_peer_eq_context *ctx = context;
	(void)f;
	if (!attr || !(attr->flags & FI_PEER) || !ctx || ctx->size < sizeof *ctx || !ctx->eq)
		return -FI_EINVAL;
	off_owner_eq = ctx->eq;
	*eq = &off_eq;
	return 0;
}

static struct fi_ops_fabric off_fabric_ops = {
	.size = sizeof(struct fi_ops_fabric),
	.eq_open = off_eq_open,
	.domain2 = off_domain2,
};
static struct fid_fabric off_fabric = {.fid = {.fclass = FI_CLASS_FABRIC}, .ops = &off_fabric_ops};

/* ---- AV sets, and a peer AV set handed to the offload peer ---- */

static struct fid_peer_av_set *off_owner_set;
static struct fid_av_set off_set = {.fid = {.fclass = FI_CLASS_AV_SET}};

static int off_av_set(struct fid_av *av, struct fi_av_set_attr *attr, struct fid_av_set **set,
		      void *context)
{
	struct fi_peer_av_set_context *ctx = context;
	(void)av;
	if (!attr || !(attr->flags & FI_PEER) || !ctx || ctx->size < sizeof *ctx || !ctx->av_set)
		return -FI_EINVAL;
	/* The 1.17 header types av_set as struct fi_peer_av_set *, which it never defines. */
	off_owner_set = (struct fid_peer_av_set *)ctx->av_set;
	*set = &off_set;
	return 0;
}

static struct fi_ops_av off_av_ops = {.size = sizeof(struct fi_ops_av), .av_set = off_av_set};
static struct fid_av off_av = {.fid = {.fclass = FI_CLASS_AV}, .ops = &off_av_ops};

/* Peer AV: the offload peer's fi_av_open with FI_PEER gets the owner's AV. */
static struct fid_peer_av *off_owner_av;

static int off_av_open(struct fid_domain *d, struct fi_av_attr *attr, struct fid_av **av,
		       void *context)
{
	struct fi_peer_av_context *ctx = context;
	(void)d;
	if (!attr || !(attr->flags & FI_PEER) || !ctx || ctx->size < sizeof *ctx || !ctx->av)
		return -FI_EINVAL;
	off_owner_av = (struct fid_peer_av *)ctx->av; /* 1.17 types it struct fi_peer_av * */
	*av = &off_av;
	return 0;
}

static struct fi_ops_domain off_av_domain_ops = {.size = sizeof(struct fi_ops_domain),
						 .av_open = off_av_open};
static struct fid_domain off_av_domain = {.fid = {.fclass = FI_CLASS_DOMAIN},
					  .ops = &off_av_domain_ops};

static void avset_check(struct fid_domain *domain, struct fid_av *av, fi_addr_t *addrs,
			struct fid_ep *ep)
{
	struct fid_av_set *set, *empty, *ps;
	struct fi_rverbs_peer_ops *ops;
	struct fi_av_set_attr a = {.count = 2, .start_addr = addrs[0], .end_addr = addrs[1],
				   .stride = addrs[1] - addrs[0]};
	struct fi_av_set_attr none = {0};
	fi_addr_t got[4], coll;
	size_t n;

	TRUE(addrs[1] > addrs[0]);
	OK(fi_av_set(av, &a, &set, NULL));
	OK(fi_av_set(av, &none, &empty, NULL));
	EXPECT(fi_av_set_insert(set, addrs[0]), -FI_EINVAL); /* already a member */
	OK(fi_av_set_remove(set, addrs[1]));
	EXPECT(fi_av_set_remove(set, addrs[1]), -FI_EINVAL);
	OK(fi_av_set_insert(set, addrs[1]));
	EXPECT(fi_av_set_insert(set, addrs[1] + 100), -FI_EINVAL); /* not in the AV */
	EXPECT(fi_av_set_addr(set, &coll), -FI_ENOSYS);
	OK(fi_av_set_union(empty, set));
	OK(fi_open_ops(&domain->fid, FI_RVERBS_PEER_OPS, 0, (void **)&ops, NULL));
	OK(ops->open_peer_av_set(empty, &off_av, &ps));
	TRUE(ps == &off_set && off_owner_set);
	/* members(): too small an array says how many; then the addresses. */
	n = 1;
	EXPECT(off_owner_set->owner_ops->members(off_owner_set, got, &n), -FI_ETOOSMALL);
	EXPECT(n, 2);
	n = 4;
	OK(off_owner_set->owner_ops->members(off_owner_set, got, &n));
	TRUE(n == 2 && got[0] == addrs[0] && got[1] == addrs[1]);
	/* Peer AV: how many addresses, and where a local endpoint is in it. */
	struct fid_av *pav;
	struct fi_av_attr q = {0};
	OK(ops->open_peer_av(av, &off_av_domain, NULL, &pav));
	TRUE(pav == &off_av && off_owner_av);
	OK(off_owner_av->owner_ops->query(off_owner_av, &q));
	TRUE(q.type == FI_AV_TABLE && q.count == 2);
	EXPECT(off_owner_av->owner_ops->ep_addr(off_owner_av, ep), addrs[0]);
	EXPECT(off_owner_av->owner_ops->ep_addr(off_owner_av, NULL), FI_ADDR_NOTAVAIL);

	OK(fi_av_set_diff(empty, set));
	n = 4;
	OK(off_owner_set->owner_ops->members(off_owner_set, got, &n));
	EXPECT(n, 0);
	EXPECT(fi_close(&empty->fid), 0);
	/* The set's peer face is a closed handle now, not freed memory. */
	n = 4;
	EXPECT(off_owner_set->owner_ops->members(off_owner_set, got, &n), -FI_EINVAL);
	EXPECT(fi_close(&set->fid), 0);
}

static void transfer_section(void)
{
	struct msg_env m = {0};
	struct side s = {0}, c = {0};
	struct fi_info *h = hints_for(FI_EP_MSG);
	struct fi_rverbs_peer_ops *ops;
	struct offload_ep a = {0}, b = {0};
	struct fid_ep *ta, *tb, *pa, *pb;
	struct fi_cq_data_entry e;
	size_t len = sizeof m.addr;
	int ctx;

	msg_env_open(&m, h);
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	connect_pair(&m, &s, &c, NULL);
	OK(fi_open_ops(&m.domain->fid, FI_RVERBS_PEER_OPS, 0, (void **)&ops, NULL));

	/* a answers on the server's endpoint, b pings on the client's. Their buffers are in
	 * memory registered with the owner's domain. */
	a.app_cq = s.cq;
	b.app_cq = c.cq;
	b.pinger = 1;
	a.dest = b.dest = FI_ADDR_UNSPEC;
	a.from = b.from = FI_ADDR_NOTAVAIL; /* connected: no source */
	off_ep_type = FI_EP_MSG;
	a.tx = m.buf + 1024, a.rx = m.buf + 2048;
	b.tx = m.buf + 3072, b.rx = m.buf + 4096;

	/* Peer domain: the offload peer registers its memory with the owner's domain. */
	struct fid_domain *pd;
	struct fid_mr *pmr;
	OK(ops->open_peer_domain(m.domain, &off_fabric, NULL, &pd));
	TRUE(pd == &off_domain && off_owner_domain == m.domain);
	OK(fi_mr_reg(off_owner_domain, m.buf, 8192, FI_SEND | FI_RECV, 0, 0, 0, &pmr, NULL));
	a.desc = b.desc = fi_mr_desc(pmr);
	/* Peer EQ: its events land in the owner's EQ. */
	struct fid_eq *peq;
	struct fi_eq_attr pea = {.wait_obj = FI_WAIT_NONE};
	OK(ops->open_peer_eq(c.eq, &off_fabric, &pea, &peq));
	TRUE(peq == &off_eq && off_owner_eq == c.eq);
	off_next = &a;
	OK(ops->open_transfer(s.ep, &off_domain, NULL, m.info, &ta, &pa));
	off_next = &b;
	OK(ops->open_transfer(c.ep, &off_domain, NULL, m.info, &tb, &pb));
	TRUE(pa == &a.ep && pb == &b.ep && a.xfer == ta && b.xfer == tb);
	/* A transfer endpoint is the peer's channel, not an endpoint of the application. */
	EXPECT(fi_ep_bind(ta, &s.cq->fid, FI_RECV), -FI_EINVAL);
	EXPECT(fi_enable(ta), -FI_ENOSYS);
	len = sizeof m.addr;
	EXPECT(fi_getname(&ta->fid, &m.addr, &len), -FI_ENOSYS);

	OK(fi_recv(ta, a.rx, 64, a.desc, FI_ADDR_UNSPEC, a.rx));
	OK(fi_recv(tb, b.rx, 64, b.desc, FI_ADDR_UNSPEC, b.rx));
	off_send(&b, 1);
	/* The application drives progress by reading its CQs, which never see the peers'. */
	time_t end = time(NULL) + 30;
	while (b.received < ROUNDS) {
		EXPECT(fi_cq_read(s.cq, &e, 1), -FI_EAGAIN);
		EXPECT(fi_cq_read(c.cq, &e, 1), -FI_EAGAIN);
		if (time(NULL) > end)
			FAIL("peer rounds: %d of %d", b.received, ROUNDS);
	}
	while (a.sent < a.received || b.sent < ROUNDS) {
		EXPECT(fi_cq_read(s.cq, &e, 1), -FI_EAGAIN);
		EXPECT(fi_cq_read(c.cq, &e, 1), -FI_EAGAIN);
		if (time(NULL) > end)
			FAIL("peer sends: a %d/%d, b %d/%d", a.sent, a.received, b.sent, ROUNDS);
	}
	TRUE(a.received == ROUNDS && b.received == ROUNDS && a.last == ROUNDS);
	TRUE(a.max_depth == 1 && b.max_depth == 1 && a.errors == 0 && b.errors == 0);
	{
		struct fi_eq_entry w = {.fid = &pb->fid, .context = &b, .data = ROUNDS}, r;
		uint32_t ev;
		EXPECT(fi_eq_read(c.eq, &ev, &r, sizeof r, 0), -FI_EAGAIN);
		EXPECT(fi_eq_write(off_owner_eq, FI_NOTIFY, &w, sizeof w, 0), sizeof w);
		EXPECT(fi_eq_sread(c.eq, &ev, &r, sizeof r, 1000, 0), sizeof r);
		TRUE(ev == FI_NOTIFY && r.fid == &pb->fid && r.context == &b && r.data == ROUNDS);
		EXPECT(fi_eq_write(off_owner_eq, FI_NOTIFY, &w, sizeof w, 1), -FI_EBADFLAGS);
	}

	/* The application's own traffic on the same endpoints still completes on its CQs. */
	OK(fi_recv(s.ep, m.buf + 8192, 64, m.desc, 0, &ctx));
	OK(fi_send(c.ep, m.buf + 12288, 16, m.desc, 0, &ctx));
	cq_expect(c.cq, &ctx, FI_SEND, 0, NULL);
	cq_expect(s.cq, &ctx, FI_RECV, 16, NULL);

	/* A failed transfer reaches comperr: a receive too small for what comes. */
	OK(fi_recv(ta, a.rx, 2, a.desc, FI_ADDR_UNSPEC, a.rx));
	memset(b.tx, 0, 64);
	OK(fi_send(tb, b.tx, 64, b.desc, FI_ADDR_UNSPEC, b.tx));
	while (a.errors == 0) {
		long r = fi_cq_read(s.cq, &e, 1);
		if (r == -FI_EAVAIL)
			FAIL("the peer's failure reached the application's CQ");
		fi_cq_read(c.cq, &e, 1);
		if (time(NULL) > end + 30)
			FAIL("no comperr for the truncated transfer");
	}

	/* Closing a link closes the peer's endpoint first. */
	EXPECT(fi_close(&ta->fid), 0);
	EXPECT(fi_close(&tb->fid), 0);
	TRUE(a.closed == 1 && b.closed == 1);
	EXPECT(fi_close(&pmr->fid), 0);
	close_side(&c, 1);
	close_side(&s, 0);
	msg_env_close(&m);
	fi_freeinfo(h);
	printf("ok transfer\n");
}

/* fi_getinfo through libfabric answers with what the hints asked, bit by bit: every
 * combination of the eight mr_mode bits (answers hold only bits offered; without
 * FI_MR_LOCAL, -FI_ENODATA), domain capabilities and rx ordering bits. */
/* What fabtests' getinfo test and servers ask of fi_getinfo, as libfabric's providers
 * answer: the old mr_mode enumerators echoed (FI_MR_BASIC) and given to callers of API 1.0;
 * FI_MR_UNSPEC hints (mr_mode 0) get no info that needs FI_MR_LOCAL unless the mode has
 * FI_LOCAL_MR; shared contexts only where they exist; an RDM server at a node and service
 * listens there, and a client naming it gets a destination name fi_av_insert takes. */
static void getinfo_rules_section(void)
{
	struct fi_info *h = hints_for(FI_EP_RDM), *info = NULL, *srv = NULL;
	h->caps = FI_MSG | FI_RMA;
	h->domain_attr->mr_mode = FI_MR_BASIC;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	for (struct fi_info *i = info; i; i = i->next)
		EXPECT(i->domain_attr->mr_mode, FI_MR_BASIC);
	fi_freeinfo(info);
	h->domain_attr->mr_mode = FI_MR_UNSPEC;
	h->ep_attr->type = FI_EP_UNSPEC;
	OK(fi_getinfo(FI_VERSION(1, 0), NULL, NULL, 0, h, &info));
	for (struct fi_info *i = info; i; i = i->next) {
		TRUE(i->domain_attr->mr_mode == FI_MR_BASIC || i->domain_attr->mr_mode == FI_MR_SCALABLE);
		TRUE(i->ep_attr->type != FI_EP_MSG); /* it needs FI_MR_LOCAL: no FI_LOCAL_MR mode */
	}
	fi_freeinfo(info);
	fi_freeinfo(h);

	/* A MSG write with remote CQ data consumes a receive: FI_RX_CQ_DATA in rx_attr.mode,
	 * and in the mode of an application that says it handles it (as verbs answers). RDM
	 * and DGRAM consume none. Primary caps are reported where asked only. */
	h = hints_for(FI_EP_MSG);
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE((info->rx_attr->mode & FI_RX_CQ_DATA) && !(info->mode & FI_RX_CQ_DATA));
	fi_freeinfo(info);
	h->mode = FI_RX_CQ_DATA;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE((info->rx_attr->mode & FI_RX_CQ_DATA) && (info->mode & FI_RX_CQ_DATA));
	fi_freeinfo(info);
	h->mode = 0;
	for (enum fi_ep_type t = FI_EP_DGRAM; t <= FI_EP_RDM; t++) {
		h->ep_attr->type = t;
		OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
		TRUE(!(info->rx_attr->mode & FI_RX_CQ_DATA) && !(info->mode & FI_RX_CQ_DATA));
		TRUE(!(info->rx_attr->caps & FI_DIRECTED_RECV) && (info->rx_attr->caps & FI_MSG));
		fi_freeinfo(info);
	}
	fi_freeinfo(h);

	h = hints_for(FI_EP_MSG);
	h->domain_attr->mr_mode = 0;
	EXPECT(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info), -FI_ENODATA);
	h->mode = FI_LOCAL_MR;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	fi_freeinfo(info);
	h->domain_attr->mr_mode = FI_MR_LOCAL;
	h->mode = 0;
	h->ep_attr->tx_ctx_cnt = FI_SHARED_CONTEXT;
	EXPECT(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info), -FI_ENODATA);
	h->ep_attr->tx_ctx_cnt = 0;
	h->ep_attr->rx_ctx_cnt = FI_SHARED_CONTEXT;
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	EXPECT(info->ep_attr->rx_ctx_cnt, FI_SHARED_CONTEXT);
	fi_freeinfo(info);
	h->ep_attr->type = FI_EP_RDM;
	h->domain_attr->mr_mode = 0;
	EXPECT(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info), -FI_ENODATA);
	h->ep_attr->rx_ctx_cnt = 2;
	EXPECT(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info), -FI_ENODATA);
	h->ep_attr->rx_ctx_cnt = 0;

	/* A server at a node and service, and a client that names it so. */
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	char ip[INET_ADDRSTRLEN];
	TRUE(info->src_addr && info->src_addrlen == sizeof(struct sockaddr_in));
	TRUE(inet_ntop(AF_INET, &((struct sockaddr_in *)info->src_addr)->sin_addr, ip, sizeof ip));
	fi_freeinfo(info);
	OK(fi_getinfo(FI_VERSION(1, 17), ip, "9311", FI_SOURCE, h, &srv));
	EXPECT(ntohs(((struct sockaddr_in *)srv->src_addr)->sin_port), 9311);
	OK(fi_getinfo(FI_VERSION(1, 17), ip, "9311", 0, h, &info));
	EXPECT(info->dest_addrlen, 40);
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_av *av;
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	fi_addr_t a = FI_ADDR_NOTAVAIL;
	OK(fi_fabric(info->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, info, &domain, NULL));
	OK(fi_av_open(domain, &av_attr, &av, NULL));
	EXPECT(fi_av_insert(av, info->dest_addr, 1, &a, 0, NULL), 1);
	EXPECT(a, 0);
	char str[128];
	size_t len = sizeof str;
	fi_av_straddr(av, info->dest_addr, str, &len);
	TRUE(strstr(str, ":9311/") != NULL);
	OK(fi_close(&av->fid));
	OK(fi_close(&domain->fid));
	OK(fi_close(&fabric->fid));
	fi_freeinfo(info);
	fi_freeinfo(srv);
	fi_freeinfo(h);
	printf("ok getinfo rules\n");
}

static void hints_section(void)
{
	static const uint64_t bits[] = {FI_MR_LOCAL,	  FI_MR_RAW,	   FI_MR_VIRT_ADDR,
					FI_MR_ALLOCATED,  FI_MR_PROV_KEY,  FI_MR_MMU_NOTIFY,
					FI_MR_RMA_EVENT,  FI_MR_ENDPOINT};
	int answered = 0;
	for (int combo = 1; combo < 256; combo++) {
		uint64_t offered = 0;
		for (int k = 0; k < 8; k++)
			if (combo & (1 << k))
				offered |= bits[k];
		struct fi_info *h = hints_for(FI_EP_MSG), *info = NULL;
		h->domain_attr->mr_mode = (int)offered;
		int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info);
		if (r == 0) {
			answered++;
			for (struct fi_info *i = info; i; i = i->next)
				if ((uint64_t)i->domain_attr->mr_mode & ~offered)
					FAIL("mr_mode %#x answered for %#lx", i->domain_attr->mr_mode,
					     (unsigned long)offered);
			fi_freeinfo(info);
		} else {
			EXPECT(r, -FI_ENODATA);
			TRUE(!(offered & FI_MR_LOCAL));
		}
		fi_freeinfo(h);
	}
	EXPECT(answered, 128);
	{
		struct fi_info *h = hints_for(FI_EP_MSG), *info = NULL;
		h->domain_attr->caps = FI_SHARED_AV;
		EXPECT(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info), -FI_ENODATA);
		h->domain_attr->caps = FI_LOCAL_COMM | FI_REMOTE_COMM;
		OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
		TRUE((info->domain_attr->caps & (FI_LOCAL_COMM | FI_REMOTE_COMM)) ==
		     (FI_LOCAL_COMM | FI_REMOTE_COMM));
		fi_freeinfo(info);
		for (int b = 0; b < 13; b++) {
			h->domain_attr->caps = 0;
			h->rx_attr->msg_order = 1ULL << b;
			int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info);
			if (r == 0) {
				TRUE(info->rx_attr->msg_order & (1ULL << b));
				fi_freeinfo(info);
			} else {
				EXPECT(r, -FI_ENODATA);
			}
		}
		fi_freeinfo(h);
	}
	printf("ok hints\n");
}

/* Reads one completion of `want` within 10 s, driving `other` (the peer endpoint's CQ) meanwhile. */
static long rdm_next(struct fid_cq *want, struct fid_cq *other, struct fi_cq_tagged_entry *e,
		     fi_addr_t *src)
{
	time_t end = time(NULL) + 10;
	for (;;) {
		long r = fi_cq_readfrom(want, e, 1, src);
		if (r != -FI_EAGAIN)
			return r;
		(void)fi_cq_read(other, NULL, 0);
		if (time(NULL) > end)
			FAIL("no RDM completion within 10 s");
	}
}

/* Posts with `call` until it is not -FI_EAGAIN (a local peer's first send over shm waits for
 * its handshake: fabtests' pattern), driving both CQs meanwhile. */
#define RDM_POST(a, b, call)                                                                \
	do {                                                                                \
		time_t end_ = time(NULL) + 10;                                              \
		ssize_t r_;                                                                 \
		while ((r_ = (call)) == -FI_EAGAIN && time(NULL) <= end_) {                 \
			(void)fi_cq_read(a, NULL, 0);                                       \
			(void)fi_cq_read(b, NULL, 0);                                       \
		}                                                                           \
		if (r_)                                                                     \
			FAIL("%s = %zd (%s)", #call, r_, fi_strerror((int)-r_));            \
	} while (0)

/* Two RDM endpoints of `info` on one domain, each with its CQ and an AV holding both
 * names (fi_addr_t 0 and 1). With `checks`, what opening them must refuse is checked too. */
struct rdm_pair {
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq[2];
	struct fid_av *av[2];
	struct fid_ep *ep[2];
	uint8_t name[2][64];
};

/* Called for each endpoint of the next pair before fi_enable (counters to bind), if set. */
static void (*rdm_pair_setup)(struct rdm_pair *p, int i);
/* The wait object of the next pair's CQs. */
static enum fi_wait_obj rdm_cq_wait = FI_WAIT_NONE;
/* The contexts of the next pair's CQs. */
static void *rdm_cq_context[2];
/* The wait set of the next pair's CQs (with rdm_cq_wait FI_WAIT_SET). */
static struct fid_wait *rdm_cq_wait_set;

static void rdm_pair_open(struct fi_info *info, struct rdm_pair *p, int checks)
{
	struct fi_av_attr aa = {.type = FI_AV_TABLE};
	struct fi_cq_attr ca = {
		.format = FI_CQ_FORMAT_TAGGED, .wait_obj = rdm_cq_wait, .wait_set = rdm_cq_wait_set};
	uint8_t small[4];
	fi_addr_t got;
	size_t len;

	OK(fi_fabric(info->fabric_attr, &p->fabric, NULL));
	OK(fi_domain(p->fabric, info, &p->domain, NULL));
	for (int i = 0; i < 2; i++) {
		OK(fi_cq_open(p->domain, &ca, &p->cq[i], rdm_cq_context[i]));
		OK(fi_av_open(p->domain, &aa, &p->av[i], NULL));
		OK(fi_endpoint(p->domain, info, &p->ep[i], NULL));
		if (checks)
			EXPECT(fi_enable(p->ep[i]), -FI_ENOAV);
		OK(fi_ep_bind(p->ep[i], &p->av[i]->fid, 0));
		OK(fi_ep_bind(p->ep[i], &p->cq[i]->fid, FI_TRANSMIT | FI_RECV));
		if (rdm_pair_setup)
			rdm_pair_setup(p, i);
		OK(fi_enable(p->ep[i]));
		if (checks) {
			len = sizeof small;
			EXPECT(fi_getname(&p->ep[i]->fid, small, &len), -FI_ETOOSMALL);
			EXPECT(len, 40);
		}
		len = sizeof p->name[i];
		OK(fi_getname(&p->ep[i]->fid, p->name[i], &len));
		EXPECT(len, 40);
	}
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < 2; j++) {
			EXPECT(fi_av_insert(p->av[i], p->name[j], 1, &got, 0, NULL), 1);
			EXPECT(got, (fi_addr_t)j);
		}
}

/* Reads `cq[want]` until one completion, driving the other endpoint's CQ meanwhile (manual
 * progress); the source too. Within 10 s. */
static void pair_readfrom(struct fid_cq *cq[2], int want, struct fi_cq_tagged_entry *e,
			  fi_addr_t *src)
{
	time_t end = time(NULL) + 10;
	for (;;) {
		(void)fi_cq_read(cq[1 - want], NULL, 0);
		ssize_t r = fi_cq_readfrom(cq[want], e, 1, src);
		if (r == 1)
			return;
		if (r != -FI_EAGAIN)
			FAIL("fi_cq_readfrom = %zd (%s)", r, fi_strerror((int)-r));
		if (time(NULL) > end)
			FAIL("no completion within 10 s");
	}
}

/* An RDM server at a node and service, and a client on the same host that knows it by them
 * alone (fabtests' default): the client reaches the server over verbs, and the server,
 * which knows the client by its whole name (a name of this host, which would go over shm),
 * answers over that connection too, so the client sees the answer come from the address it
 * inserted. */
static void rdm_listener_section(void)
{
	struct fi_info *h = rdm_hints(FI_MSG | FI_TAGGED | FI_SOURCE), *info = NULL, *srv = NULL,
		       *cli = NULL;
	struct fi_av_attr aa = {.type = FI_AV_TABLE};
	struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_TAGGED};
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq[2];
	struct fid_av *av[2];
	struct fid_ep *ep[2];
	struct fi_cq_tagged_entry e;
	uint8_t name[64], buf[2][256], msg[100];
	fi_addr_t a, src;
	size_t len = sizeof name;
	char ip[INET_ADDRSTRLEN];

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE(inet_ntop(AF_INET, &((struct sockaddr_in *)info->src_addr)->sin_addr, ip, sizeof ip));
	OK(fi_getinfo(FI_VERSION(1, 17), ip, "9313", FI_SOURCE, h, &srv));
	OK(fi_getinfo(FI_VERSION(1, 17), ip, "9313", 0, h, &cli));
	OK(fi_fabric(srv->fabric_attr, &fabric, NULL));
	OK(fi_domain(fabric, srv, &domain, NULL));
	for (int i = 0; i < 2; i++) {
		OK(fi_cq_open(domain, &ca, &cq[i], NULL));
		OK(fi_av_open(domain, &aa, &av[i], NULL));
		OK(fi_endpoint(domain, i ? cli : srv, &ep[i], NULL));
		OK(fi_ep_bind(ep[i], &av[i]->fid, 0));
		OK(fi_ep_bind(ep[i], &cq[i]->fid, FI_TRANSMIT | FI_RECV));
		OK(fi_enable(ep[i]));
	}
	/* The client inserts what getinfo gave it; the server, the client's own name. */
	EXPECT(fi_av_insert(av[1], cli->dest_addr, 1, &a, 0, NULL), 1);
	EXPECT(a, 0);
	OK(fi_getname(&ep[1]->fid, name, &len));
	EXPECT(fi_av_insert(av[0], name, 1, &a, 0, NULL), 1);
	EXPECT(a, 0);
	fill(msg, sizeof msg, 3);
	OK(fi_trecv(ep[0], buf[0], sizeof buf[0], NULL, FI_ADDR_UNSPEC, 7, 0, (void *)1));
	OK(fi_tsend(ep[1], msg, sizeof msg, NULL, 0, 7, (void *)2));
	pair_readfrom(cq, 0, &e, &src);
	EXPECT(e.op_context, 1);
	EXPECT(src, 0);
	check(buf[0], sizeof msg, 3);
	pair_readfrom(cq, 1, &e, &src);
	EXPECT(e.op_context, 2);
	/* The answer, from the server to the client's whole (local) name. */
	OK(fi_trecv(ep[1], buf[1], sizeof buf[1], NULL, FI_ADDR_UNSPEC, 8, 0, (void *)3));
	ssize_t r;
	while ((r = fi_tsend(ep[0], msg, 50, NULL, 0, 8, (void *)4)) == -FI_EAGAIN)
		(void)fi_cq_read(cq[1], NULL, 0);
	OK(r);
	pair_readfrom(cq, 1, &e, &src);
	EXPECT(e.op_context, 3);
	EXPECT(e.len, 50);
	EXPECT(src, 0); /* the listener's name: it came over that connection */
	check(buf[1], 50, 3);
	pair_readfrom(cq, 0, &e, &src);
	EXPECT(e.op_context, 4);
	for (int i = 0; i < 2; i++) {
		OK(fi_close(&ep[i]->fid));
		OK(fi_close(&av[i]->fid));
		OK(fi_close(&cq[i]->fid));
	}
	OK(fi_close(&domain->fid));
	OK(fi_close(&fabric->fid));
	fi_freeinfo(info);
	fi_freeinfo(srv);
	fi_freeinfo(cli);
	fi_freeinfo(h);
	printf("ok rdm listener\n");
}

static struct fid_cntr *remote_rd, *remote_wr;

static void rdm_pair_close(struct rdm_pair *p)
{
	for (int i = 0; i < 2; i++) {
		OK(fi_close(&p->ep[i]->fid));
		OK(fi_close(&p->av[i]->fid));
		OK(fi_close(&p->cq[i]->fid));
	}
	/* Counters the pair's setup opened go before their domain. */
	if (remote_rd) {
		OK(fi_close(&remote_rd->fid));
		OK(fi_close(&remote_wr->fid));
		remote_rd = remote_wr = NULL;
	}
	OK(fi_close(&p->domain->fid));
	OK(fi_close(&p->fabric->fid));
}

/* The other end of rdm_sread_wakes: 200 ms after the read blocked, a first message to a
 * peer it never sent to; then it reads its own CQ until the send completes (progress is
 * manual: over verbs, its connection is made only as it reads). Returns the send's status. */
static void *rdm_late_send(void *arg)
{
	struct rdm_pair *p = arg;
	struct timespec nap = {.tv_nsec = 200 * 1000 * 1000};
	static uint8_t late[5] = "late";
	struct fi_cq_tagged_entry e;
	time_t end;
	ssize_t r;

	nanosleep(&nap, NULL);
	end = time(NULL) + 10;
	while ((r = fi_tsend(p->ep[0], late, sizeof late, NULL, 1, 0x55, (void *)41)) == -FI_EAGAIN &&
	       time(NULL) <= end)
		(void)fi_cq_read(p->cq[0], NULL, 0);
	if (r)
		return (void *)(intptr_t)r;
	while ((r = fi_cq_read(p->cq[0], &e, 1)) == -FI_EAGAIN && time(NULL) <= end)
		;
	if (r == 1 && e.op_context != (void *)41)
		r = -FI_EOTHER;
	return (void *)(intptr_t)(r == 1 ? 0 : r);
}

/* fi_cq_sread on an RDM endpoint (wait object UNSPEC) blocked before the first message from
 * a peer exists: over shm (no descriptor: the sender rings the receiver's bell, after a
 * handshake the blocked read drives) or, with FI_RVERBS_RDM_SHM=0, over a verbs connection
 * the blocked read accepts. */
static void rdm_sread_wakes(struct fi_info *info, uint8_t *rbuf)
{
	struct rdm_pair q;
	struct fi_cq_tagged_entry e;
	pthread_t t;
	void *ret;

	rdm_cq_wait = FI_WAIT_UNSPEC;
	rdm_pair_open(info, &q, 0);
	rdm_cq_wait = FI_WAIT_NONE;
	OK(fi_trecv(q.ep[1], rbuf, 64, NULL, FI_ADDR_UNSPEC, 0x55, 0, (void *)40));
	EXPECT(pthread_create(&t, NULL, rdm_late_send, &q), 0);
	EXPECT(fi_cq_sread(q.cq[1], &e, 1, NULL, 10000), 1);
	TRUE(e.op_context == (void *)40 && e.len == 5 && e.tag == 0x55);
	TRUE(!memcmp(rbuf, "late", 5));
	EXPECT(pthread_join(t, &ret), 0);
	EXPECT((intptr_t)ret, 0);
	rdm_pair_close(&q);
}

static void rdm_section(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	struct fid_cq **cq = p.cq;
	struct fid_av **av = p.av;
	struct fid_ep **ep = p.ep;
	uint8_t (*name)[64] = p.name;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err = {0};
	uint8_t sbuf[256];
	size_t len;
	fi_addr_t src;
	char str[128];
	uint8_t *rbuf = malloc(BUF); /* unregistered: RDM asks no FI_MR_LOCAL */

	TRUE(h && rbuf);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_TAGGED | FI_SOURCE | FI_DIRECTED_RECV;
	h->mode = 0;
	h->domain_attr->mr_mode = 0;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	EXPECT(info->ep_attr->type, FI_EP_RDM);
	TRUE(!(info->domain_attr->mr_mode & FI_MR_LOCAL));
	EXPECT(info->domain_attr->cq_data_size, 8);
	TRUE(info->ep_attr->mem_tag_format == 0xaaaaaaaaaaaaaaaaULL); /* providers' FI_TAG_GENERIC */
	TRUE((info->caps & (FI_TAGGED | FI_SOURCE)) == (FI_TAGGED | FI_SOURCE));
	rdm_pair_open(info, &p, 1);
	len = sizeof str;
	TRUE(fi_av_straddr(av[0], name[1], str, &len) && !strncmp(str, "fi_rverbs_rdm://", 16));

	/* Tagged, from and to unregistered memory: the receiver knows the source. */
	fill(sbuf, 200, 3);
	OK(fi_trecv(ep[1], rbuf, BUF, NULL, FI_ADDR_UNSPEC, 0x42, 0, (void *)1));
	RDM_POST(cq[0], cq[1], fi_tsend(ep[0], sbuf, 200, NULL, 1, 0x42, (void *)2));
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	TRUE(e.op_context == (void *)1 && e.len == 200 && e.tag == 0x42 &&
	     (e.flags & (FI_TAGGED | FI_RECV)) == (FI_TAGGED | FI_RECV));
	EXPECT(src, 0);
	check(rbuf, 200, 3);
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.op_context == (void *)2 && (e.flags & (FI_TAGGED | FI_SEND)) == (FI_TAGGED | FI_SEND));

	/* 64-bit remote CQ data, untagged, the other way. */
	OK(fi_recv(ep[0], rbuf, 64, NULL, 1, (void *)3));
	RDM_POST(cq[1], cq[0], fi_senddata(ep[1], sbuf, 10, NULL, 0x1122334455667788ULL, 0, (void *)4));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.op_context == (void *)3 && (e.flags & FI_REMOTE_CQ_DATA) &&
	     e.data == 0x1122334455667788ULL && e.len == 10);
	EXPECT(src, 1);
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	EXPECT(e.op_context, (void *)4);

	/* tinject: the buffer is free at return, and no completion is written. */
	fill(sbuf, 256, 9);
	RDM_POST(cq[0], cq[1], fi_tinject(ep[0], sbuf, 256, 1, 7));
	memset(sbuf, 0, sizeof sbuf);
	OK(fi_trecv(ep[1], rbuf, BUF, NULL, 0, 7, 0, (void *)5));
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	TRUE(e.op_context == (void *)5 && e.len == 256);
	check(rbuf, 256, 9);
	EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);

	/* Past the eager size: the receiver reads the message from the sender's buffer
	 * (rendezvous), unregistered on both sides; a truncated one completes both sides. */
	{
		size_t big = (1 << 20) + 5;
		uint8_t *bs = malloc(big), *br = malloc(big);
		TRUE(bs && br);
		fill(bs, big, 11);
		RDM_POST(cq[0], cq[1], fi_tsend(ep[0], bs, big, NULL, 1, 0x77, (void *)20));
		OK(fi_trecv(ep[1], br, big, NULL, FI_ADDR_UNSPEC, 0x77, 0, (void *)21));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
		TRUE(e.op_context == (void *)21 && e.len == big && e.tag == 0x77);
		check(br, big, 11);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)20);
		OK(fi_trecv(ep[1], br, 100000, NULL, FI_ADDR_UNSPEC, 0x78, 0, (void *)22));
		RDM_POST(cq[0], cq[1], fi_tsend(ep[0], bs, big, NULL, 1, 0x78, (void *)23));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), -FI_EAVAIL);
		EXPECT(fi_cq_readerr(cq[1], &err, 0), 1);
		TRUE(err.op_context == (void *)22 && err.err == FI_ETRUNC && err.len == 100000 &&
		     err.olen == big - 100000);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)23);
		free(bs);
		free(br);
	}

	/* Gathered past the segmented size (fi_tsendv, fi_tsendmsg): the receiver reads the
	 * ranges in order; as many as tx_attr.iov_limit, one more is refused. Then a message of
	 * more than two RDMA reads (the port's max_msg_sz each), below max_msg_size. */
	{
		size_t part[3] = {70000, 1, 200003}, total = 270004;
		struct iovec iov[33];
		uint8_t *g = malloc(total), *br = malloc(total);
		TRUE(g && br);
		EXPECT(info->tx_attr->iov_limit, 32);
		fill(g, total, 13);
		for (size_t i = 0, at = 0; i < 3; at += part[i], i++)
			iov[i] = (struct iovec){.iov_base = g + at, .iov_len = part[i]};
		OK(fi_trecv(ep[1], br, total, NULL, FI_ADDR_UNSPEC, 0x79, 0, (void *)24));
		RDM_POST(cq[0], cq[1], fi_tsendv(ep[0], iov, NULL, 3, 1, 0x79, (void *)25));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
		TRUE(e.op_context == (void *)24 && e.len == total);
		check(br, total, 13);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)25);
		memset(br, 0, total);
		struct fi_msg_tagged tm = {.msg_iov = iov, .iov_count = 3, .addr = 1, .tag = 0x7a,
					   .context = (void *)26, .data = 0xdada};
		RDM_POST(cq[0], cq[1], fi_tsendmsg(ep[0], &tm, FI_REMOTE_CQ_DATA | FI_COMPLETION));
		OK(fi_trecv(ep[1], br, total, NULL, FI_ADDR_UNSPEC, 0x7a, 0, (void *)27));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
		TRUE(e.op_context == (void *)27 && e.len == total && e.data == 0xdada);
		check(br, total, 13);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)26);
		for (int i = 0; i < 33; i++)
			iov[i] = (struct iovec){.iov_base = g, .iov_len = 4096};
		EXPECT(fi_tsendv(ep[0], iov, NULL, 33, 1, 0x7b, NULL), -FI_EINVAL);
		/* Received into three ranges (fi_trecvv), small and past the segmented size: the
		 * message fills them in order; a fourth range is refused. */
		EXPECT(info->rx_attr->iov_limit, 3);
		for (size_t n = 100; n <= 200000; n *= 2000) {
			struct iovec riov[4];
			size_t cut[3] = {n / 3, n / 3, n - 2 * (n / 3)};
			memset(br, 0, total);
			for (size_t i = 0, at = 0; i < 3; at += cut[i], i++)
				riov[i] = (struct iovec){.iov_base = br + at + i * 64, .iov_len = cut[i]};
			OK(fi_trecvv(ep[1], riov, NULL, 3, FI_ADDR_UNSPEC, 0x7d, 0, (void *)30));
			RDM_POST(cq[0], cq[1], fi_tsend(ep[0], g, n, NULL, 1, 0x7d, (void *)31));
			EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
			TRUE(e.op_context == (void *)30 && e.len == n);
			for (size_t i = 0, at = 0; i < 3; at += cut[i], i++)
				TRUE(!memcmp(br + at + i * 64, g + at, cut[i]));
			EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
			EXPECT(e.op_context, (void *)31);
			riov[3] = riov[2];
			EXPECT(fi_trecvv(ep[1], riov, NULL, 4, FI_ADDR_UNSPEC, 0x7d, 0, NULL), -FI_EINVAL);
		}
		free(g);
		free(br);
		size_t n = 17 << 20; /* three reads of rxe's 8 MiB */
		TRUE(info->ep_attr->max_msg_size >= n);
		uint8_t *ls = malloc(n), *lr = malloc(n);
		TRUE(ls && lr);
		fill(ls, n, 14);
		OK(fi_trecv(ep[1], lr, n, NULL, FI_ADDR_UNSPEC, 0x7c, 0, (void *)28));
		RDM_POST(cq[0], cq[1], fi_tsend(ep[0], ls, n, NULL, 1, 0x7c, (void *)29));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
		TRUE(e.op_context == (void *)28 && e.len == n);
		check(lr, n, 14);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)29);
		free(ls);
		free(lr);
	}

	/* Cancel: the receive completes as FI_ECANCELED; a second cancel finds nothing. */
	OK(fi_trecv(ep[1], rbuf, BUF, NULL, 0, 99, 0, (void *)6));
	OK(fi_cancel(&ep[1]->fid, (void *)6));
	EXPECT(fi_cq_read(cq[1], &e, 1), -FI_EAVAIL);
	EXPECT(fi_cq_readerr(cq[1], &err, 0), 1);
	TRUE(err.op_context == (void *)6 && err.err == FI_ECANCELED);
	EXPECT(fi_cancel(&ep[1]->fid, (void *)6), -FI_ENOENT);

	/* What is not built yet says so; what is wrong says why. */
	{
		struct iovec iov = {.iov_base = rbuf, .iov_len = 64};
		struct fi_msg_tagged tm = {.msg_iov = &iov, .iov_count = 1, .addr = 0, .tag = 1};
		OK(fi_trecvmsg(ep[1], &tm, FI_PEEK)); /* nothing waits: FI_ENOMSG */
		EXPECT(fi_cq_read(cq[1], &e, 1), -FI_EAVAIL);
		EXPECT(fi_cq_readerr(cq[1], &err, 0), 1);
		EXPECT(err.err, FI_ENOMSG);
		EXPECT(fi_trecvmsg(ep[1], &tm, FI_CLAIM), -FI_EINVAL); /* nothing claimed */
		/* FI_DELIVERY_COMPLETE: the send completes once the message is in a receive's
		 * buffer, not when the peer's device has it. */
		tm.addr = 1;
		tm.tag = 0x99;
		tm.context = (void *)30;
		RDM_POST(cq[0], cq[1], fi_tsendmsg(ep[0], &tm, FI_DELIVERY_COMPLETE));
		for (int i = 0; i < 20000; i++) {
			(void)fi_cq_read(cq[1], NULL, 0);
			EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);
		}
		OK(fi_trecv(ep[1], sbuf, sizeof sbuf, NULL, FI_ADDR_UNSPEC, 0x99, 0, (void *)31));
		EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
		EXPECT(e.op_context, (void *)31);
		EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
		EXPECT(e.op_context, (void *)30);
		tm.addr = 0;
		EXPECT(fi_tsend(ep[0], rbuf, info->ep_attr->max_msg_size + 1, NULL, 1, 1, NULL),
		       -FI_EMSGSIZE);
		EXPECT(fi_tinject(ep[0], rbuf, info->tx_attr->inject_size + 1, 1, 1), -FI_EINVAL);
		EXPECT(fi_send(ep[0], sbuf, 1, NULL, 5, NULL), -FI_EINVAL);
		EXPECT(fi_connect(ep[0], name[1], NULL, 0), -FI_EINVAL);
	}
	rdm_pair_close(&p);
	rdm_sread_wakes(info, rbuf);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(rbuf);
	printf("ok rdm\n");
}

/* FI_PEER_TRANSFER over RDM endpoints: the offload peer's traffic is matched apart from
 * the application's (neither takes the other's receives), completes through its callbacks
 * with the sender's fi_addr_t as source, and never reaches the application's CQs. */
/* One tagged rendezvous message of `n` bytes from `sb` (pattern `seed`) into `rb`, bytes
 * checked: one receive and one send posted, both completed. */
static void rdm_rndv_once(struct rdm_pair *p, uint8_t *sb, uint8_t *rb, size_t n, uint8_t seed)
{
	struct fi_cq_tagged_entry e;
	fi_addr_t src;

	fill(sb, n, seed);
	memset(rb, 0, n);
	OK(fi_trecv(p->ep[1], rb, n, NULL, FI_ADDR_UNSPEC, 0x77, 0, (void *)11));
	RDM_POST(p->cq[0], p->cq[1], fi_tsend(p->ep[0], sb, n, NULL, 1, 0x77, (void *)12));
	EXPECT(rdm_next(p->cq[1], p->cq[0], &e, &src), 1);
	TRUE(e.op_context == (void *)11 && e.len == n);
	EXPECT(rdm_next(p->cq[0], p->cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)12);
	check(rb, n, seed);
}

/* Anonymous memory at `hint` (just unmapped there), or anywhere when that is taken. */
static uint8_t *map_at(void *hint, size_t len)
{
	uint8_t *m = mmap(hint, len, PROT_READ | PROT_WRITE,
			  MAP_PRIVATE | MAP_ANONYMOUS | (hint ? MAP_FIXED_NOREPLACE : 0), -1, 0);
	if (m == MAP_FAILED && hint)
		m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	TRUE(m != MAP_FAILED);
	return m;
}

/* Unregistered buffers past the segmented size are registered for the peer's read and the
 * read's landing, and kept in the domain's registration cache. An entry must never outlive
 * its memory: a buffer unmapped and mapped again at the same address, emptied with
 * madvise, or moved with mremap carries (or receives) its new bytes, not the old pages'. */
static void rdm_mr_cache_section(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	/* Buffers that fill their mappings, as glibc's large allocations do: the kernel keeps a
	 * watched range as a mapping of its own, and mremap moves only whole mappings. */
	const size_t n = (1 << 20) + 5, len = (1 << 20) + 4096;
	uint8_t *sb, *rb, *old;
	int same = 0;

	TRUE(h);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_TAGGED;
	h->domain_attr->mr_mode = 0;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	rdm_pair_open(info, &p, 0);
	sb = map_at(NULL, len);
	rb = map_at(NULL, len);
	for (int k = 0; k < 3; k++)
		rdm_rndv_once(&p, sb, rb, n, (uint8_t)k);

	/* Unmapped and mapped again: new pages at the same address, on both sides. */
	old = sb;
	TRUE(munmap(sb, len) == 0);
	sb = map_at(old, len);
	same += sb == old;
	rdm_rndv_once(&p, sb, rb, n, 40);
	old = rb;
	TRUE(munmap(rb, len) == 0);
	rb = map_at(old, len);
	same += rb == old;
	rdm_rndv_once(&p, sb, rb, n, 41);

	/* Emptied: the pages are replaced by zero pages on the next touch. */
	TRUE(madvise(sb, len, MADV_DONTNEED) == 0);
	TRUE(madvise(rb, len, MADV_DONTNEED) == 0);
	rdm_rndv_once(&p, sb, rb, n, 42);

	/* Moved: the old address is no longer this memory. */
	sb = mremap(sb, len, 2 * len, MREMAP_MAYMOVE);
	TRUE(sb != MAP_FAILED);
	rdm_rndv_once(&p, sb, rb, n, 43);

	/* Heap buffers freed and allocated again (glibc maps and unmaps large ones). */
	for (int k = 0; k < 4; k++) {
		uint8_t *hs = malloc(n), *hr = malloc(n);
		TRUE(hs && hr);
		rdm_rndv_once(&p, hs, hr, n, (uint8_t)(50 + k));
		free(hs);
		free(hr);
	}
	/* A hostile caller: a buffer that is not mapped (a range just unmapped; PROT_NONE
	 * would not do: the kernel pins such pages for a read-only registration, as for any
	 * provider). The send fails at the call and posts nothing; a receive into it fails at
	 * delivery, and both its side and the sender's get an error entry (FI_EIO): of the two
	 * posted, two completed. The good buffers still go through. */
	{
		uint8_t *bad = map_at(NULL, len);
		struct fi_cq_tagged_entry e;
		struct fi_cq_err_entry err = {0};
		fi_addr_t src;
		ssize_t r;

		TRUE(munmap(bad, len) == 0);
		r = fi_tsend(p.ep[0], bad, n, NULL, 1, 0x77, (void *)13);
		TRUE(r < 0 && r != -FI_EAGAIN);
		fill(sb, n, 60);
		OK(fi_trecv(p.ep[1], bad, n, NULL, FI_ADDR_UNSPEC, 0x77, 0, (void *)14));
		RDM_POST(p.cq[0], p.cq[1], fi_tsend(p.ep[0], sb, n, NULL, 1, 0x77, (void *)15));
		EXPECT(rdm_next(p.cq[1], p.cq[0], &e, &src), -FI_EAVAIL);
		EXPECT(fi_cq_readerr(p.cq[1], &err, 0), 1);
		TRUE(err.op_context == (void *)14 && err.err == FI_EIO);
		memset(&err, 0, sizeof err);
		EXPECT(rdm_next(p.cq[0], p.cq[1], &e, &src), -FI_EAVAIL);
		EXPECT(fi_cq_readerr(p.cq[0], &err, 0), 1);
		TRUE(err.op_context == (void *)15 && err.err == FI_EIO);
		rdm_rndv_once(&p, sb, rb, n, 61);
	}
	TRUE(munmap(sb, 2 * len) == 0 && munmap(rb, len) == 0);
	rdm_pair_close(&p);
	fi_freeinfo(info);
	fi_freeinfo(h);
	TRUE(same >= 1); /* else nothing here tests an address used again */
	printf("ok rdm-mr-cache\n");
}

static void rdm_transfer_section(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	struct fid_cq **cq = p.cq;
	struct fid_ep **ep = p.ep, *ta, *tb, *pa, *pb;
	struct fi_cq_tagged_entry e;
	struct fi_rverbs_peer_ops *ops;
	struct offload_ep a = {0}, b = {0};
	uint8_t *buf = calloc(1, 16384); /* unregistered: RDM asks no FI_MR_LOCAL */
	fi_addr_t src;
	int app_ctx, app_sctx;

	TRUE(h && buf);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_TAGGED | FI_SOURCE;
	h->mode = 0;
	h->domain_attr->mr_mode = 0;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	rdm_pair_open(info, &p, 0);
	OK(fi_open_ops(&p.domain->fid, FI_RVERBS_PEER_OPS, 0, (void **)&ops, NULL));

	/* a (on ep[0]) answers, b (on ep[1]) pings; tagged transfers, each side's address. */
	a.app_cq = cq[0], b.app_cq = cq[1];
	b.pinger = 1;
	a.tagged = b.tagged = 1;
	a.dest = 1, b.dest = 0;
	a.from = 1, b.from = 0;
	a.tx = buf + 1024, a.rx = buf + 2048;
	b.tx = buf + 3072, b.rx = buf + 4096;
	off_ep_type = FI_EP_RDM;
	off_next = &a;
	OK(ops->open_transfer(ep[0], &off_domain, NULL, info, &ta, &pa));
	off_next = &b;
	OK(ops->open_transfer(ep[1], &off_domain, NULL, info, &tb, &pb));
	TRUE(pa == &a.ep && pb == &b.ep && a.xfer == ta && b.xfer == tb);
	/* One link per endpoint. */
	off_next = &a;
	EXPECT(ops->open_transfer(ep[0], &off_domain, NULL, info, &ta, &pa), -FI_EBUSY);
	EXPECT(fi_ep_bind(ta, &cq[0]->fid, FI_RECV), -FI_EINVAL);
	EXPECT(fi_enable(ta), -FI_ENOSYS);
	EXPECT(fi_recvmsg(ta, &(struct fi_msg){.msg_iov = &(struct iovec){a.rx, 64}, .iov_count = 1},
			  FI_MULTI_RECV),
	       -FI_EINVAL);

	/* The application's own untagged receive waits on ep[0] meanwhile: the peer's
	 * untagged transfer below must not take it. */
	OK(fi_recv(ep[0], buf + 8192, 64, NULL, FI_ADDR_UNSPEC, &app_ctx));
	off_recv(&a, 64);
	off_recv(&b, 64);
	off_send(&b, 1);
	time_t end = time(NULL) + 30;
	while (b.received < ROUNDS || a.sent < a.received || b.sent < ROUNDS) {
		EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);
		EXPECT(fi_cq_read(cq[1], &e, 1), -FI_EAGAIN);
		if (time(NULL) > end)
			FAIL("RDM peer rounds: a %d/%d, b %d/%d", a.received, a.sent, b.received,
			     b.sent);
	}
	TRUE(a.received == ROUNDS && b.received == ROUNDS && a.last == ROUNDS);
	TRUE(a.max_depth == 1 && b.max_depth == 1 && a.errors == 0 && b.errors == 0);

	/* An untagged transfer: the peer's untagged receive takes it, not the application's. */
	a.tagged = b.tagged = 0;
	off_recv(&a, 64);
	off_send(&b, ROUNDS + 1);
	while (a.received < ROUNDS + 1 || a.sent < a.received) {
		EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);
		(void)fi_cq_read(cq[1], &e, 1);
		if (time(NULL) > end)
			FAIL("the peer's untagged transfer did not arrive");
	}
	EXPECT(a.last, ROUNDS + 1);
	/* The application's traffic on the same endpoints completes on its CQs. */
	fill(buf + 12288, 16, 5);
	RDM_POST(cq[1], cq[0], fi_send(ep[1], buf + 12288, 16, NULL, 0, &app_sctx));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.op_context == &app_ctx && e.len == 16 && (e.flags & FI_RECV));
	EXPECT(src, 1);
	check(buf + 8192, 16, 5);
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	EXPECT(e.op_context, &app_sctx);

	/* A failed transfer reaches comperr: a receive too small for what comes. */
	a.tagged = b.tagged = 1;
	off_recv(&a, 2);
	memset(b.tx, 0, 64);
	OK(fi_tsend(tb, b.tx, 64, NULL, 0, OFF_TAG, b.tx));
	while (a.errors == 0) {
		long r = fi_cq_read(cq[0], &e, 1);
		if (r == -FI_EAVAIL)
			FAIL("the peer's failure reached the application's CQ");
		(void)fi_cq_read(cq[1], &e, 1);
		if (time(NULL) > end + 30)
			FAIL("no comperr for the truncated RDM transfer");
	}

	/* Closing a link closes the peer's endpoint first; the endpoint lives on. */
	EXPECT(fi_close(&ta->fid), 0);
	EXPECT(fi_close(&tb->fid), 0);
	TRUE(a.closed == 1 && b.closed == 1);
	OK(fi_recv(ep[0], buf + 8192, 64, NULL, FI_ADDR_UNSPEC, &app_ctx));
	RDM_POST(cq[1], cq[0], fi_send(ep[1], buf + 12288, 16, NULL, 0, &app_sctx));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, &app_ctx);
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	rdm_pair_close(&p);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(buf);
	printf("ok rdm-transfer\n");
}

/* fi_rma(3) over a connected pair: every call with bytes checked, remote CQ data completing
 * a receive at the target, bad input refused, and an access the target did not grant
 * reported as an error completion with nothing written. */
static void rma_section(void)
{
	struct msg_env m = {0};
	struct side s = {0}, c = {0};
	struct fi_info *h = hints_for(FI_EP_MSG);
	struct fid_mr *tmr, *lmr, *romr;
	uint8_t *target = aligned_alloc(4096, BUF), *local = aligned_alloc(4096, BUF);
	uint8_t *ro = aligned_alloc(4096, 4096);
	struct fi_cq_data_entry e;
	struct fi_cq_err_entry err = {0};
	int ctx[8];
	size_t len;

	h->caps = FI_MSG | FI_RMA;
	pair_caps = h->caps;
	msg_env_open(&m, h);
	TRUE(m.info->caps & FI_RMA);
	TRUE((m.info->domain_attr->mr_mode & (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY)) ==
	     (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY));
	len = sizeof m.addr;
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	connect_pair(&m, &s, &c, NULL);
	OK(fi_mr_reg(m.domain, target, BUF, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &tmr, NULL));
	OK(fi_mr_reg(m.domain, local, BUF, FI_WRITE | FI_READ, 0, 0, 0, &lmr, NULL));
	uint64_t key = fi_mr_key(tmr);
	void *ld = fi_mr_desc(lmr);
	TRUE(key != FI_KEY_NOTAVAIL);

	fill(local, 4096, 7);
	memset(target, 0, BUF);
	OK(fi_write(c.ep, local, 4096, ld, 0, (uintptr_t)(target + 64), key, &ctx[0]));
	cq_expect(c.cq, &ctx[0], FI_WRITE, 0, &e);
	EXPECT(e.flags, FI_RMA | FI_WRITE);
	check(target + 64, 4096, 7);
	TRUE(target[63] == 0 && target[64 + 4096] == 0);

	fill(target, 8192, 9);
	memset(local, 0, BUF);
	OK(fi_read(c.ep, local, 8192, ld, 0, (uintptr_t)target, key, &ctx[1]));
	cq_expect(c.cq, &ctx[1], FI_READ, 0, &e);
	EXPECT(e.flags, FI_RMA | FI_READ);
	check(local, 8192, 9);

	OK(fi_recv(s.ep, m.buf, 64, m.desc, 0, &ctx[2]));
	fill(local, 100, 3);
	OK(fi_writedata(c.ep, local, 100, ld, 0xabcd, 0, (uintptr_t)target, key, &ctx[3]));
	cq_expect(c.cq, &ctx[3], FI_WRITE, 0, NULL);
	EXPECT(cq_wait(s.cq, &e), 1);
	TRUE(e.op_context == &ctx[2] && e.data == 0xabcd && e.len == 100);
	EXPECT(e.flags, FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA);
	check(target, 100, 3);

	OK(fi_inject_write(c.ep, "inject!", 8, 0, (uintptr_t)(target + 1000), key));
	OK(fi_read(c.ep, local, 8, ld, 0, (uintptr_t)(target + 1000), key, &ctx[4]));
	cq_expect(c.cq, &ctx[4], FI_READ, 0, NULL);
	TRUE(memcmp(local, "inject!", 8) == 0);

	struct iovec iov[2] = {{local, 10}, {local + 100, 20}};
	void *descs[2] = {ld, ld};
	struct fi_rma_iov rio = {.addr = (uintptr_t)(target + 2000), .len = 30, .key = key};
	struct fi_msg_rma msg = {.msg_iov = iov, .desc = descs, .iov_count = 2, .rma_iov = &rio,
				 .rma_iov_count = 1, .context = &ctx[5]};
	fill(local, 10, 21);
	fill(local + 100, 20, 22);
	OK(fi_writemsg(c.ep, &msg, FI_COMPLETION));
	cq_expect(c.cq, &ctx[5], FI_WRITE, 0, NULL);
	check(target + 2000, 10, 21);
	check(target + 2010, 20, 22);
	memset(local, 0, 200);
	OK(fi_readv(c.ep, iov, descs, 2, 0, (uintptr_t)(target + 2000), key, &ctx[6]));
	cq_expect(c.cq, &ctx[6], FI_READ, 0, NULL);
	check(local, 10, 21);
	check(local + 100, 20, 22);

	/* Bad input: refused, nothing posted. */
	msg.rma_iov_count = 2;
	EXPECT(fi_writemsg(c.ep, &msg, 0), -FI_EINVAL);
	msg.rma_iov_count = 1;
	EXPECT(fi_readmsg(c.ep, &msg, FI_INJECT), -FI_EINVAL);
	EXPECT(fi_write(c.ep, local, 8, ld, 0, (uintptr_t)target, 1ULL << 40, &ctx[7]), -FI_EINVAL);
	EXPECT(fi_write(c.ep, local, 8, NULL, 0, (uintptr_t)target, key, &ctx[7]), -FI_EINVAL);
	EXPECT(fi_cq_read(c.cq, &e, 1), -FI_EAGAIN);

	/* A region registered for remote read only is no write target. */
	OK(fi_mr_reg(m.domain, ro, 4096, FI_REMOTE_READ, 0, 0, 0, &romr, NULL));
	memset(ro, 0x11, 4096);
	OK(fi_write(c.ep, local, 64, ld, 0, (uintptr_t)ro, fi_mr_key(romr), &ctx[7]));
	EXPECT(cq_wait(c.cq, &e), -FI_EAVAIL);
	EXPECT(fi_cq_readerr(c.cq, &err, 0), 1);
	TRUE(err.op_context == &ctx[7] && (err.flags & FI_WRITE));
	EXPECT(err.err, FI_EACCES);
	for (int i = 0; i < 4096; i++)
		TRUE(ro[i] == 0x11);

	close_side(&c, 1);
	close_side(&s, 0);
	EXPECT(fi_close(&romr->fid), 0);
	EXPECT(fi_close(&lmr->fid), 0);
	EXPECT(fi_close(&tmr->fid), 0);
	msg_env_close(&m);
	fi_freeinfo(h);
	free(target);
	free(local);
	free(ro);
	pair_caps = FI_MSG;
	printf("ok rma\n");
}

/* fi_rma(3) on RDM endpoints: writes and reads connect on first use, from and into
 * unregistered memory (copied when small, registered for the operation when large) or
 * registered memory named by its descriptor; remote CQ data keeps 64 bits and reaches the
 * target's CQ with the writer's fi_addr_t; bad input is refused, a denied access fails. */
/* The target (endpoint 1) of the next pair counts remote reads and writes. */
static void bind_remote_cntrs(struct rdm_pair *p, int i)
{
	struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
	if (i == 0) {
		OK(fi_cntr_open(p->domain, &ca, &remote_rd, NULL));
		OK(fi_cntr_open(p->domain, &ca, &remote_wr, NULL));
		return;
	}
	OK(fi_ep_bind(p->ep[1], &remote_rd->fid, FI_REMOTE_READ));
	OK(fi_ep_bind(p->ep[1], &remote_wr->fid, FI_REMOTE_WRITE));
}

/* Offset addressing (an mr_mode without FI_MR_VIRT_ADDR: remote addresses are offsets into
 * the region) and FI_RMA_EVENT (the target counts the RMA that reaches it). */
static void rdm_rma_offset_events(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	struct fi_cq_tagged_entry e;
	struct fid_mr *tmr;
	uint8_t *target = aligned_alloc(4096, 4096), local[64];
	fi_addr_t src;
	time_t end;

	TRUE(h && target);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_TAGGED | FI_RMA | FI_RMA_EVENT;
	h->mode = 0;
	h->domain_attr->mr_mode = FI_MR_PROV_KEY;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	EXPECT(info->domain_attr->mr_mode, FI_MR_PROV_KEY);
	TRUE(info->caps & FI_RMA_EVENT);
	rdm_pair_setup = bind_remote_cntrs;
	rdm_pair_open(info, &p, 0);
	rdm_pair_setup = NULL;
	OK(fi_mr_reg(p.domain, target, 4096, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &tmr,
		     NULL));
	memset(target, 0, 4096);
	RDM_POST(p.cq[0], p.cq[1],
		 fi_write(p.ep[0], "by offset", 9, NULL, 1, 100, fi_mr_key(tmr), (void *)1));
	EXPECT(rdm_next(p.cq[0], p.cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)1);
	TRUE(!memcmp(target + 100, "by offset", 9));
	TRUE(target[99] == 0 && target[109] == 0);
	memset(local, 0, sizeof local);
	RDM_POST(p.cq[0], p.cq[1],
		 fi_read(p.ep[0], local, 9, NULL, 1, 100, fi_mr_key(tmr), (void *)2));
	EXPECT(rdm_next(p.cq[0], p.cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)2);
	TRUE(!memcmp(local, "by offset", 9));
	/* Reading the target's counters drives it: one write and one read arrived. */
	end = time(NULL) + 10;
	while (fi_cntr_read(remote_wr) < 1 || fi_cntr_read(remote_rd) < 1) {
		(void)fi_cq_read(p.cq[0], NULL, 0);
		if (time(NULL) > end)
			FAIL("remote counters read %lu writes, %lu reads", fi_cntr_read(remote_wr),
			     fi_cntr_read(remote_rd));
	}
	EXPECT(fi_cntr_read(remote_wr), 1);
	EXPECT(fi_cntr_read(remote_rd), 1);
	EXPECT(fi_cq_read(p.cq[1], &e, 1), -FI_EAGAIN); /* no CQ data: no entry */

	/* A counter bound to the region (fi_mr_bind, as fabtests' fi_multi_mr): it counts the
	 * writes to that region alone, and its wait drives the target. */
	{
		struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
		struct fid_cntr *rc;
		struct fid_mr *other;
		uint8_t *o = aligned_alloc(4096, 4096);
		OK(fi_cntr_open(p.domain, &ca, &rc, NULL));
		OK(fi_mr_reg(p.domain, o, 4096, FI_REMOTE_WRITE, 0, 0, 0, &other, NULL));
		EXPECT(fi_mr_bind(tmr, &rc->fid, FI_REMOTE_READ), -FI_EINVAL);
		EXPECT(fi_mr_bind(tmr, &p.ep[1]->fid, 0), -FI_EINVAL); /* no FI_MR_ENDPOINT */
		EXPECT(fi_mr_bind(tmr, NULL, FI_REMOTE_WRITE), -FI_EINVAL);
		OK(fi_mr_bind(tmr, &rc->fid, FI_REMOTE_WRITE));
		RDM_POST(p.cq[0], p.cq[1],
			 fi_write(p.ep[0], "other", 5, NULL, 1, 0, fi_mr_key(other), (void *)3));
		RDM_POST(p.cq[0], p.cq[1],
			 fi_write(p.ep[0], "counted", 7, NULL, 1, 200, fi_mr_key(tmr), (void *)4));
		for (int n = 0; n < 2;)
			if (fi_cq_read(p.cq[0], &e, 1) == 1)
				n++;
		OK(fi_cntr_wait(rc, 1, 10000));
		EXPECT(fi_cntr_wait(rc, 2, 300), -FI_ETIMEDOUT);
		EXPECT(fi_cntr_read(rc), 1);
		EXPECT(fi_cntr_read(remote_wr), 3);
		TRUE(!memcmp(target + 200, "counted", 7) && !memcmp(o, "other", 5));
		EXPECT(fi_close(&rc->fid), -FI_EBUSY); /* bound until the region closes */
		OK(fi_close(&other->fid));
		OK(fi_close(&tmr->fid));
		OK(fi_close(&rc->fid));
		free(o);
	}
	rdm_pair_close(&p);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(target);
}

static void rdm_rma_section(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	struct fid_cq **cq = p.cq;
	struct fid_ep **ep = p.ep;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err = {0};
	struct fid_mr *tmr, *lmr, *romr;
	size_t big = (1 << 20) + 3;
	uint8_t *target = aligned_alloc(4096, 2 << 20), *local = malloc(big);
	uint8_t *reg = aligned_alloc(4096, 2 << 20), *ro = aligned_alloc(4096, 4096);
	fi_addr_t src;

	TRUE(h && target && local && reg && ro);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_TAGGED | FI_RMA;
	h->mode = 0;
	h->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE(info->caps & FI_RMA); /* no direction named: both (fi_getinfo(3)) */
	EXPECT(info->domain_attr->mr_mode, FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED);
	rdm_pair_open(info, &p, 0);
	OK(fi_mr_reg(p.domain, target, 2 << 20, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &tmr,
		     NULL));
	OK(fi_mr_reg(p.domain, reg, 2 << 20, FI_WRITE | FI_READ, 0, 0, 0, &lmr, NULL));
	uint64_t key = fi_mr_key(tmr), t = (uintptr_t)target;
	memset(target, 0, 2 << 20);

	/* Small from unregistered memory: copied, the first operation connects. */
	fill(local, 300, 1);
	RDM_POST(cq[0], cq[1], fi_write(ep[0], local, 300, NULL, 1, t + 8, key, (void *)1));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.op_context == (void *)1 && e.flags == (FI_RMA | FI_WRITE));
	check(target + 8, 300, 1);
	TRUE(target[7] == 0 && target[308] == 0);
	/* Large from unregistered memory (registered for the operation) and from a region. */
	fill(local, big, 2);
	RDM_POST(cq[0], cq[1], fi_write(ep[0], local, big, NULL, 1, t, key, (void *)2));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)2);
	check(target, big, 2);
	fill(reg, big, 3);
	RDM_POST(cq[0], cq[1],
		 fi_write(ep[0], reg, big, fi_mr_desc(lmr), 1, t + 100, key, (void *)3));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)3);
	check(target + 100, big, 3);
	/* Reads back, small and large, into unregistered memory and into the region. */
	memset(local, 0, big);
	RDM_POST(cq[0], cq[1], fi_read(ep[0], local, 64, NULL, 1, t + 100, key, (void *)4));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.op_context == (void *)4 && e.flags == (FI_RMA | FI_READ));
	check(local, 64, 3);
	RDM_POST(cq[0], cq[1], fi_read(ep[0], local, big, NULL, 1, t + 100, key, (void *)5));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)5);
	check(local, big, 3);
	memset(reg, 0, big);
	RDM_POST(cq[0], cq[1],
		 fi_read(ep[0], reg, big, fi_mr_desc(lmr), 1, t + 100, key, (void *)6));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	check(reg, big, 3);

	/* Remote CQ data: at the target, with 64 bits, the length and the writer's address. */
	fill(local, 40, 4);
	RDM_POST(cq[1], cq[0],
		 fi_writedata(ep[1], local, 40, NULL, 0x8877665544332211ULL, 0,
			      (uintptr_t)target, key, (void *)7));
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	EXPECT(e.op_context, (void *)7);
	/* ep[1] wrote to its own domain's region through ep[0]'s address 0: loopback target. */
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	TRUE(e.flags == (FI_RMA | FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA) &&
	     e.data == 0x8877665544332211ULL && e.len == 40 && e.op_context == NULL);
	EXPECT(src, 1);
	check(target, 40, 4);

	/* Injected, vectored and msg forms. */
	RDM_POST(cq[0], cq[1], fi_inject_write(ep[0], "inject!", 8, 1, t + 5000, key));
	RDM_POST(cq[0], cq[1], fi_inject_writedata(ep[0], "data", 4, 5, 1, t + 6000, key));
	EXPECT(rdm_next(cq[1], cq[0], &e, &src), 1);
	TRUE(e.data == 5 && e.len == 4 && (e.flags & FI_REMOTE_CQ_DATA));
	TRUE(!memcmp(target + 5000, "inject!", 8) && !memcmp(target + 6000, "data", 4));
	EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);
	struct iovec iov[2] = {{local, 10}, {local + 100, 20}};
	struct fi_rma_iov rio = {.addr = t + 7000, .len = 30, .key = key};
	struct fi_msg_rma msg = {.msg_iov = iov, .iov_count = 2, .addr = 1, .rma_iov = &rio,
				 .rma_iov_count = 1, .context = (void *)8};
	fill(local, 10, 5);
	fill(local + 100, 20, 6);
	RDM_POST(cq[0], cq[1], fi_writemsg(ep[0], &msg, FI_COMPLETION));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)8);
	check(target + 7000, 10, 5);
	check(target + 7010, 20, 6);
	memset(local, 0, 200);
	RDM_POST(cq[0], cq[1], fi_readv(ep[0], iov, NULL, 2, 1, t + 7000, key, (void *)9));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	EXPECT(e.op_context, (void *)9);
	check(local, 10, 5);
	check(local + 100, 20, 6);

	/* Bad input: refused, nothing posted. */
	msg.rma_iov_count = 2;
	EXPECT(fi_writemsg(ep[0], &msg, 0), -FI_EINVAL);
	msg.rma_iov_count = 1;
	EXPECT(fi_readmsg(ep[0], &msg, FI_INJECT), -FI_EINVAL);
	EXPECT(fi_write(ep[0], local, 8, NULL, 1, t, 1ULL << 40, NULL), -FI_EINVAL);
	EXPECT(fi_inject_write(ep[0], local, info->tx_attr->inject_size + 1, 1, t, key), -FI_EINVAL);
	EXPECT(fi_write(ep[0], local, 8, (void *)ro, 1, t, key, NULL), -FI_EINVAL); /* not a desc */
	EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);

	/* A region registered for remote read only is no write target. */
	OK(fi_mr_reg(p.domain, ro, 4096, FI_REMOTE_READ, 0, 0, 0, &romr, NULL));
	memset(ro, 0x11, 4096);
	RDM_POST(cq[0], cq[1],
		 fi_write(ep[0], local, 64, NULL, 1, (uintptr_t)ro, fi_mr_key(romr), (void *)10));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), -FI_EAVAIL);
	EXPECT(fi_cq_readerr(cq[0], &err, 0), 1);
	TRUE(err.op_context == (void *)10 && (err.flags & FI_WRITE));
	EXPECT(err.err, FI_EACCES);
	for (int i = 0; i < 4096; i++)
		TRUE(ro[i] == 0x11);

	EXPECT(fi_close(&romr->fid), 0);
	EXPECT(fi_close(&lmr->fid), 0);
	EXPECT(fi_close(&tmr->fid), 0);
	rdm_pair_close(&p);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(target);
	free(local);
	free(reg);
	free(ro);
	rdm_rma_offset_events();
	printf("ok rdm-rma\n");
}

/* fi_atomic(3) on an RDM pair, as fabtests' fi_rdm_atomic and Open MPI's btl ofi call it:
 * what the valid calls and fi_query_atomic say, every offered operation in its plain, v,
 * msg and inject forms with the target's word checked, refusals with nothing posted, and an
 * access the target did not grant as an error completion with the word unchanged. */
static void rdm_atomic_section(void)
{
	struct fi_info *h = fi_allocinfo(), *info;
	struct rdm_pair p;
	struct fid_cq **cq = p.cq;
	struct fid_ep **ep = p.ep;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err = {0};
	struct fi_atomic_attr attr;
	struct fid_mr *tmr, *romr, *rmr;
	uint64_t *target = aligned_alloc(4096, 4096), *ro = aligned_alloc(4096, 4096);
	uint64_t *res = aligned_alloc(4096, 4096);
	uint64_t one = 1, v, cmpv, out = 0;
	size_t count, posted = 0, done = 0;
	fi_addr_t src;

	TRUE(h && target && ro && res);
	h->ep_attr->type = FI_EP_RDM;
	h->caps = FI_MSG | FI_ATOMIC;
	h->mode = FI_CONTEXT;
	h->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED;
	h->fabric_attr->prov_name = strdup("rverbs");
	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	TRUE(info->caps & FI_ATOMIC);
	TRUE((info->tx_attr->caps & (FI_ATOMIC | FI_READ | FI_WRITE)) ==
	     (FI_ATOMIC | FI_READ | FI_WRITE));
	rdm_pair_open(info, &p, 0);

	/* What is offered: the device's atomics on one 8-byte element. */
	count = 0;
	OK(fi_atomicvalid(ep[0], FI_UINT64, FI_SUM, &count));
	EXPECT(count, 1);
	OK(fi_fetch_atomicvalid(ep[0], FI_INT64, FI_SUM, &count));
	OK(fi_fetch_atomicvalid(ep[0], FI_DOUBLE, FI_ATOMIC_READ, &count));
	OK(fi_compare_atomicvalid(ep[0], FI_UINT64, FI_CSWAP, &count));
	OK(fi_atomicvalid(ep[0], FI_DOUBLE, FI_ATOMIC_WRITE, &count));
	/* Open MPI's btl ofi: add, swap and compare-and-swap, 32-bit too. */
	OK(fi_fetch_atomicvalid(ep[0], FI_INT32, FI_SUM, &count));
	OK(fi_fetch_atomicvalid(ep[0], FI_INT32, FI_ATOMIC_WRITE, &count));
	OK(fi_compare_atomicvalid(ep[0], FI_INT32, FI_CSWAP, &count));
	OK(fi_atomicvalid(ep[0], FI_DOUBLE, FI_SUM, &count));
	OK(fi_atomicvalid(ep[0], FI_UINT8, FI_BOR, &count));
	OK(fi_compare_atomicvalid(ep[0], FI_UINT16, FI_MSWAP, &count));
	EXPECT(count, 1);
	EXPECT(fi_atomicvalid(ep[0], FI_LONG_DOUBLE, FI_SUM, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_atomicvalid(ep[0], FI_FLOAT_COMPLEX, FI_SUM, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_atomicvalid(ep[0], FI_DOUBLE, FI_BOR, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_atomicvalid(ep[0], FI_UINT64, FI_ATOMIC_READ, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_compare_atomicvalid(ep[0], FI_UINT64, FI_SUM, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_compare_atomicvalid(ep[0], FI_FLOAT, FI_MSWAP, &count), -FI_EOPNOTSUPP);
	EXPECT(fi_atomicvalid(ep[0], (enum fi_datatype)99, FI_SUM, &count), -FI_EINVAL);
	EXPECT(fi_atomicvalid(ep[0], FI_UINT64, FI_SUM, NULL), -FI_EINVAL);
	OK(fi_query_atomic(p.domain, FI_UINT64, FI_CSWAP, &attr, FI_COMPARE_ATOMIC));
	TRUE(attr.count == 1 && attr.size == 8);
	EXPECT(fi_query_atomic(p.domain, FI_UINT64, FI_CSWAP, &attr, 0), -FI_EOPNOTSUPP);
	EXPECT(fi_query_atomic(p.domain, FI_UINT64, FI_SUM, &attr,
			       FI_FETCH_ATOMIC | FI_COMPARE_ATOMIC), -FI_EBADFLAGS);
	EXPECT(fi_query_atomic(p.domain, FI_UINT64, FI_SUM, &attr, FI_TAGGED), -FI_EOPNOTSUPP);

	OK(fi_mr_reg(p.domain, target, 4096, FI_REMOTE_WRITE | FI_REMOTE_READ, 0, 0, 0, &tmr,
		     NULL));
	OK(fi_mr_reg(p.domain, res, 4096, FI_READ, 0, 0, 0, &rmr, NULL));
	uint64_t key = fi_mr_key(tmr), t = (uintptr_t)target;
	memset(target, 0, 4096);
	target[0] = 100;

	/* fi_fetch_atomic (FI_SUM): the original into unregistered memory; the first call
	 * connects. */
	v = 5;
	RDM_POST(cq[0], cq[1],
		 fi_fetch_atomic(ep[0], &v, 1, NULL, &out, NULL, 1, t, key, FI_UINT64, FI_SUM,
				 (void *)1));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)1 && e.flags == (FI_ATOMIC | FI_READ));
	TRUE(out == 100 && target[0] == 105);
	/* fi_atomic (FI_SUM), no result. */
	v = 7;
	RDM_POST(cq[0], cq[1],
		 fi_atomic(ep[0], &v, 1, NULL, 1, t, key, FI_INT64, FI_SUM, (void *)2));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)2 && e.flags == (FI_ATOMIC | FI_WRITE));
	EXPECT(target[0], 112);
	/* fi_compare_atomic (FI_CSWAP) into a registered result, by its descriptor. */
	v = 9;
	cmpv = 112;
	RDM_POST(cq[0], cq[1],
		 fi_compare_atomic(ep[0], &v, 1, NULL, &cmpv, NULL, res, fi_mr_desc(rmr), 1, t, key,
				   FI_UINT64, FI_CSWAP, (void *)3));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)3 && res[0] == 112 && target[0] == 9);
	/* The v forms: a swap that does not match, then an atomic read. */
	struct fi_ioc op_ioc = {&v, 1}, cmp_ioc = {&cmpv, 1}, res_ioc = {&res[1], 1};
	v = 50;
	RDM_POST(cq[0], cq[1],
		 fi_compare_atomicv(ep[0], &op_ioc, NULL, 1, &cmp_ioc, NULL, 1, &res_ioc, NULL, 1,
				    1, t, key, FI_INT64, FI_CSWAP, (void *)4));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)4 && res[1] == 9 && target[0] == 9);
	res_ioc.addr = &res[2];
	RDM_POST(cq[0], cq[1],
		 fi_fetch_atomicv(ep[0], NULL, NULL, 0, &res_ioc, NULL, 1, 1, t, key, FI_UINT64,
				  FI_ATOMIC_READ, (void *)5));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)5 && res[2] == 9);
	/* The msg form (FI_ATOMIC_WRITE of a double) and inject (no completion). */
	double d = 2.5;
	struct fi_ioc d_ioc = {&d, 1};
	struct fi_rma_ioc rio = {.addr = t + 8, .count = 1, .key = key};
	struct fi_msg_atomic msg = {.msg_iov = &d_ioc, .iov_count = 1, .addr = 1,
				    .rma_iov = &rio, .rma_iov_count = 1, .datatype = FI_DOUBLE,
				    .op = FI_ATOMIC_WRITE, .context = (void *)6};
	RDM_POST(cq[0], cq[1], fi_atomicmsg(ep[0], &msg, FI_COMPLETION));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)6 && !memcmp(&target[1], &d, 8));
	RDM_POST(cq[0], cq[1], fi_inject_atomic(ep[0], &one, 1, 1, t, key, FI_UINT64, FI_SUM));
	posted++;
	res_ioc.addr = &res[3];
	msg.msg_iov = NULL;
	msg.iov_count = 0;
	msg.datatype = FI_UINT64;
	msg.op = FI_ATOMIC_READ;
	msg.context = (void *)7;
	rio.addr = t;
	rio.count = 0; /* FI_ATOMIC_READ: the remote count is the result's, 0 operands */
	RDM_POST(cq[0], cq[1], fi_fetch_atomicmsg(ep[0], &msg, &res_ioc, NULL, 1, 0));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done += 2; /* the inject completes with nothing: the read after it sees it */
	TRUE(e.op_context == (void *)7 && res[3] == 10 && target[0] == 10);
	/* A 32-bit swap (fetching FI_ATOMIC_WRITE) in the upper half of a word, by
	 * compare-and-swap on the word: the lower half stays. */
	uint32_t *halves = (uint32_t *)&target[4], sw = 0xabcd, old32 = 0;
	halves[0] = 0x1111;
	halves[1] = 0x2222;
	RDM_POST(cq[0], cq[1],
		 fi_fetch_atomic(ep[0], &sw, 1, NULL, &old32, NULL, 1, t + 36, key, FI_INT32,
				 FI_ATOMIC_WRITE, (void *)11));
	posted++;
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), 1);
	done++;
	TRUE(e.op_context == (void *)11 && old32 == 0x2222);
	TRUE(halves[0] == 0x1111 && halves[1] == 0xabcd);
	EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);
	EXPECT(fi_cq_read(cq[1], &e, 1), -FI_EAGAIN); /* nothing at the target's CQ */
	EXPECT(posted, 9);
	EXPECT(done, 9);

	/* Bad input: refused, nothing posted. */
	EXPECT(fi_atomic(ep[0], &v, 2, NULL, 1, t, key, FI_UINT64, FI_SUM, NULL), -FI_EMSGSIZE);
	EXPECT(fi_atomic(ep[0], &v, 0, NULL, 1, t, key, FI_UINT64, FI_SUM, NULL), -FI_EINVAL);
	EXPECT(fi_atomic(ep[0], &v, 1, NULL, 1, t, key, FI_LONG_DOUBLE, FI_SUM, NULL),
	       -FI_EOPNOTSUPP);
	EXPECT(fi_atomic(ep[0], &v, 1, NULL, 1, t + 2, key, FI_INT32, FI_SUM, NULL),
	       -FI_EINVAL); /* misaligned */
	EXPECT(fi_atomic(ep[0], &v, 1, NULL, 1, t, key, FI_UINT64, FI_CSWAP, NULL), -FI_EOPNOTSUPP);
	EXPECT(fi_atomic(ep[0], &v, 1, NULL, 1, t, key, (enum fi_datatype)77, FI_SUM, NULL),
	       -FI_EINVAL);
	EXPECT(fi_fetch_atomic(ep[0], &v, 1, NULL, NULL, NULL, 1, t, key, FI_UINT64, FI_SUM, NULL),
	       -FI_EINVAL);
	EXPECT(fi_atomic(ep[0], &v, 1, NULL, 1, t, 1ULL << 40, FI_UINT64, FI_SUM, NULL),
	       -FI_EINVAL);
	EXPECT(fi_atomic(ep[0], &v, 1, (void *)ro, 1, t, key, FI_UINT64, FI_SUM, NULL),
	       -FI_EINVAL); /* not a descriptor */
	msg.rma_iov_count = 2;
	EXPECT(fi_fetch_atomicmsg(ep[0], &msg, &res_ioc, NULL, 1, 0), -FI_EINVAL);
	EXPECT(fi_cq_read(cq[0], &e, 1), -FI_EAGAIN);

	/* A region registered for remote read only takes no atomic: an error completion, the
	 * word unchanged. */
	OK(fi_mr_reg(p.domain, ro, 4096, FI_REMOTE_READ, 0, 0, 0, &romr, NULL));
	ro[0] = 3;
	RDM_POST(cq[0], cq[1],
		 fi_fetch_atomic(ep[0], &one, 1, NULL, &out, NULL, 1, (uintptr_t)ro,
				 fi_mr_key(romr), FI_UINT64, FI_SUM, (void *)10));
	EXPECT(rdm_next(cq[0], cq[1], &e, &src), -FI_EAVAIL);
	EXPECT(fi_cq_readerr(cq[0], &err, 0), 1);
	TRUE(err.op_context == (void *)10 && (err.flags & FI_ATOMIC));
	EXPECT(err.err, FI_EACCES);
	EXPECT(ro[0], 3);

	EXPECT(fi_close(&romr->fid), 0);
	EXPECT(fi_close(&rmr->fid), 0);
	EXPECT(fi_close(&tmr->fid), 0);
	rdm_pair_close(&p);
	fi_freeinfo(info);
	fi_freeinfo(h);
	free(target);
	free(ro);
	free(res);
	printf("ok rdm-atomic (%zu posted, %zu done)\n", posted, done);
}

/* The other end of the mutex/cond counter test: once the waiter sleeps (its mutex is
 * free), a value call. */
static struct fid_cntr *late_cntr;
static pthread_mutex_t *late_mutex;

static void *cntr_late_add(void *arg)
{
	struct timespec nap = {.tv_nsec = 1000 * 1000};

	(void)arg;
	while (pthread_mutex_trylock(late_mutex))
		nanosleep(&nap, NULL);
	pthread_mutex_unlock(late_mutex);
	return (void *)(intptr_t)fi_cntr_add(late_cntr, 1);
}

/* fi_cntr(3) on a connected pair: counters count every send and receive, including those
 * selective completion keeps off the CQ and injects; fi_cntr_wait drives progress; the
 * value calls; bad attributes and binds are refused; a bound counter does not close. */
static void cntr_section(void)
{
	struct msg_env m = {0};
	struct side s = {0}, c = {0};
	struct fi_info *h = hints_for(FI_EP_MSG);
	struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
	struct fid_cntr *tx, *rx, *none, *bad;
	struct fi_cq_data_entry e;
	enum fi_wait_obj wo;
	size_t len;
	int i;

	msg_env_open(&m, h);
	len = sizeof m.addr;
	OK(fi_getname(&m.pep->fid, &m.addr, &len));
	OK(fi_cntr_open(m.domain, &ca, &tx, NULL));
	OK(fi_cntr_open(m.domain, NULL, &rx, NULL)); /* NULL attributes: the defaults */
	OK(fi_control(&rx->fid, FI_GETWAITOBJ, &wo));
	EXPECT(wo, FI_WAIT_NONE);
	OK(fi_close(&rx->fid));
	ca.wait_obj = FI_WAIT_FD;
	OK(fi_cntr_open(m.domain, &ca, &rx, NULL));
	ca.wait_obj = FI_WAIT_UNSPEC;

	/* The value calls, on a counter nothing feeds yet. */
	EXPECT(fi_cntr_read(tx), 0);
	OK(fi_cntr_add(tx, 5));
	EXPECT(fi_cntr_read(tx), 5);
	OK(fi_cntr_wait(tx, 5, 0));
	EXPECT(fi_cntr_wait(tx, 6, 20), -FI_ETIMEDOUT);
	OK(fi_cntr_set(tx, 0));
	OK(fi_cntr_adderr(tx, 2));
	EXPECT(fi_cntr_readerr(tx), 2);
	OK(fi_cntr_seterr(tx, 0));
	EXPECT(fi_cntr_readerr(tx), 0);
	ca.wait_obj = FI_WAIT_NONE;
	OK(fi_cntr_open(m.domain, &ca, &none, NULL));
	EXPECT(fi_cntr_wait(none, 0, 0), -FI_EINVAL); /* fi_cntr(3): invalid with FI_WAIT_NONE */
	OK(fi_close(&none->fid));
	ca.flags = 1;
	EXPECT(fi_cntr_open(m.domain, &ca, &bad, NULL), -FI_EINVAL);
	ca.flags = 0;
	ca.events = 7;
	EXPECT(fi_cntr_open(m.domain, &ca, &bad, NULL), -FI_EINVAL);
	ca.events = FI_CNTR_EVENTS_COMP;

	/* Sends and receives that make no CQ entry still count. */
	pair_cq_flags = FI_SELECTIVE_COMPLETION;
	pair_cq_wait = FI_WAIT_FD;
	pair_cntr[0] = tx;
	pair_cntr[1] = rx;
	pair_cntr_flags[0] = FI_SEND;
	pair_cntr_flags[1] = FI_RECV;
	connect_pair(&m, &s, &c, NULL);
	for (i = 0; i < 16; i++)
		OK(fi_recv(s.ep, m.buf + 64 * i, 64, m.desc, 0, NULL));
	for (i = 0; i < 8; i++) {
		fill(m.buf + 4096 + 64 * i, 64, (uint8_t)i);
		OK(fi_send(c.ep, m.buf + 4096 + 64 * i, 64, m.desc, 0, NULL));
	}
	for (i = 8; i < 16; i++) {
		fill(m.buf + 4096 + 64 * i, 64, (uint8_t)i);
		OK(fi_inject(c.ep, m.buf + 4096 + 64 * i, 64, 0));
	}
	OK(fi_cntr_wait(tx, 16, 5000));
	EXPECT(fi_cntr_read(tx), 16);
	OK(fi_cntr_wait(rx, 16, 5000));
	EXPECT(fi_cntr_read(rx), 16);
	EXPECT(fi_cntr_readerr(tx) + fi_cntr_readerr(rx), 0);
	for (i = 0; i < 16; i++)
		check(m.buf + 64 * i, 64, (uint8_t)i);
	EXPECT(fi_cq_read(c.cq, &e, 1), -FI_EAGAIN);
	EXPECT(fi_cq_read(s.cq, &e, 1), -FI_EAGAIN);
	/* One asked for with FI_COMPLETION reaches the CQ too. */
	OK(fi_recv(s.ep, m.buf, 64, m.desc, 0, NULL));
	struct iovec iov = {m.buf + 4096, 8};
	struct fi_msg msg = {.msg_iov = &iov, .desc = &m.desc, .iov_count = 1, .context = &e};
	OK(fi_sendmsg(c.ep, &msg, FI_COMPLETION));
	OK(fi_cntr_wait(tx, 17, 5000));
	cq_expect(c.cq, &e, FI_SEND, 0, NULL);
	OK(fi_cntr_wait(rx, 17, 5000));

	/* FI_GETWAIT: an FD counter's descriptor wakes poll() for a completion it counts, and
	 * for a value set meanwhile; fi_trywait readies it (libfabric's wait loop). */
	{
		int fd = -1;
		struct fid *f = &rx->fid;
		struct pollfd pfd;

		EXPECT(fi_control(&tx->fid, FI_GETWAIT, &fd), -FI_EINVAL); /* not FI_WAIT_FD */
		OK(fi_control(&rx->fid, FI_GETWAIT, &fd));
		TRUE(fd >= 0);
		OK(fi_trywait(m.fabric, &f, 1));
		pfd = (struct pollfd){.fd = fd, .events = POLLIN};
		EXPECT(poll(&pfd, 1, 100), 0);
		OK(fi_recv(s.ep, m.buf, 64, m.desc, 0, NULL));
		OK(fi_inject(c.ep, m.buf + 4096, 8, 0));
		EXPECT(poll(&pfd, 1, 5000), 1);
		EXPECT(fi_cntr_read(rx), 18);
		OK(fi_trywait(m.fabric, &f, 1));
		EXPECT(poll(&pfd, 1, 0), 0);
		OK(fi_cntr_add(rx, 1));
		EXPECT(poll(&pfd, 1, 5000), 1);
		EXPECT(fi_cntr_read(rx), 19);
	}

	/* FI_GETWAIT on an FI_WAIT_MUTEX_COND counter: its pair (the cond timed on
	 * CLOCK_MONOTONIC) is broadcast when a count changes, here by another thread's add
	 * while this one waits; and by progress (a completion counted as another thread reads
	 * the CQ), as the Rust device test shows. */
	{
		struct fid_cntr *mcc;
		struct fi_mutex_cond mc = {0};
		struct timespec until;
		pthread_t t;
		void *ret;
		int rc;

		ca.wait_obj = FI_WAIT_MUTEX_COND;
		OK(fi_cntr_open(m.domain, &ca, &mcc, NULL));
		ca.wait_obj = FI_WAIT_UNSPEC;
		OK(fi_control(&mcc->fid, FI_GETWAIT, &mc));
		TRUE(mc.mutex && mc.cond);
		late_cntr = mcc;
		late_mutex = mc.mutex;
		EXPECT(pthread_mutex_lock(mc.mutex), 0);
		EXPECT(pthread_create(&t, NULL, cntr_late_add, NULL), 0);
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += 10;
		do
			rc = pthread_cond_timedwait(mc.cond, mc.mutex, &until);
		while (rc == 0 && fi_cntr_read(mcc) == 0);
		EXPECT(rc, 0); /* woken, not timed out */
		EXPECT(pthread_mutex_unlock(mc.mutex), 0);
		EXPECT(pthread_join(t, &ret), 0);
		EXPECT((intptr_t)ret, 0);
		EXPECT(fi_cntr_read(mcc), 1);
		/* A value call while this thread holds the mutex neither blocks nor is lost to
		 * the count. */
		EXPECT(pthread_mutex_lock(mc.mutex), 0);
		OK(fi_cntr_add(mcc, 1));
		EXPECT(pthread_mutex_unlock(mc.mutex), 0);
		EXPECT(fi_cntr_read(mcc), 2);
		EXPECT(fi_control(&tx->fid, FI_GETWAIT, &mc), -FI_EINVAL); /* FI_WAIT_UNSPEC */
		OK(fi_close(&mcc->fid));
	}

	/* Binds the man pages refuse. */
	EXPECT(fi_ep_bind(c.ep, &rx->fid, FI_RECV), -FI_EOPBADSTATE); /* enabled */
	EXPECT(fi_close(&tx->fid), -FI_EBUSY);
	close_side(&c, 1);
	close_side(&s, 0);
	pair_cq_flags = 0;
	pair_cq_wait = FI_WAIT_NONE;
	pair_cntr[0] = pair_cntr[1] = NULL;
	OK(fi_close(&tx->fid));
	OK(fi_close(&rx->fid));
	/* A closed counter answers as one: a read is 0, the rest -FI_EINVAL. */
	EXPECT(fi_cntr_read(tx), 0);
	EXPECT(fi_cntr_add(tx, 1), -FI_EINVAL);
	EXPECT(fi_cntr_wait(tx, 0, 0), -FI_EINVAL);
	EXPECT(fi_close(&tx->fid), -FI_EINVAL);
	msg_env_close(&m);
	fi_freeinfo(h);
	printf("ok cntr\n");
}

/* Poll sets (fi_poll(3)) as fabtests' fi_poll uses them, over an RDM pair: a CQ is
 * reported while it holds an unread entry, a counter when its count moved since the set
 * last reported it; members stay busy until fi_poll_del. */
static struct fid_cntr *poll_cntr[2];

static void poll_pair_setup(struct rdm_pair *p, int i)
{
	struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_NONE};

	OK(fi_cntr_open(p->domain, &ca, &poll_cntr[i], &poll_cntr[i]));
	OK(fi_ep_bind(p->ep[i], &poll_cntr[i]->fid, i == 0 ? FI_SEND : FI_RECV));
}

/* fi_poll until it reports something, within 10 s: how many contexts. */
static int poll_until(struct fid_poll *set, void **ctx, int count)
{
	time_t end = time(NULL) + 10;
	int n;

	while ((n = fi_poll(set, ctx, count)) == 0 && time(NULL) <= end)
		;
	if (n <= 0)
		FAIL("fi_poll = %d (%s)", n, n ? fi_strerror(-n) : "nothing within 10 s");
	return n;
}

static void poll_section(void)
{
	struct fi_info *h = rdm_hints(FI_MSG | FI_TAGGED), *info;
	struct fi_cq_attr qa = {.format = FI_CQ_FORMAT_TAGGED};
	struct fi_poll_attr pa = {0};
	struct fi_cq_tagged_entry e;
	struct fid_poll *set, *bad;
	struct fid_cq *spare;
	struct rdm_pair p;
	uint8_t sbuf[64], rbuf[64];
	void *ctx[8];
	int n, posted = 0, completed = 0;

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	rdm_cq_context[0] = &p.cq[0];
	rdm_cq_context[1] = &p.cq[1];
	rdm_pair_setup = poll_pair_setup;
	rdm_pair_open(info, &p, 0);
	rdm_pair_setup = NULL;
	rdm_cq_context[0] = rdm_cq_context[1] = NULL;

	pa.flags = 1;
	EXPECT(fi_poll_open(p.domain, &pa, &bad), -FI_EINVAL);
	pa.flags = 0;
	OK(fi_poll_open(p.domain, &pa, &set));
	OK(fi_poll_add(set, &p.cq[0]->fid, 0));
	OK(fi_poll_add(set, &p.cq[1]->fid, 0));
	OK(fi_poll_add(set, &p.cq[1]->fid, 0)); /* twice: no change (libfabric's util) */
	OK(fi_poll_add(set, &poll_cntr[0]->fid, 0));
	OK(fi_poll_add(set, &poll_cntr[1]->fid, 0));
	EXPECT(fi_poll_add(set, &p.av[0]->fid, 0), -FI_EINVAL); /* not a CQ or a counter */
	EXPECT(fi_poll_add(set, &p.cq[0]->fid, 1), -FI_EINVAL); /* no flags are defined */
	EXPECT(fi_poll_add(set, NULL, 0), -FI_EINVAL);
	EXPECT(fi_poll(set, ctx, 0), -FI_EINVAL);
	EXPECT(fi_poll(set, NULL, 4), -FI_EINVAL);
	EXPECT(fi_poll(set, ctx, 8), 0); /* nothing happened yet */

	/* A member is busy until it leaves the set. */
	OK(fi_cq_open(p.domain, &qa, &spare, &spare));
	OK(fi_poll_add(set, &spare->fid, 0));
	EXPECT(fi_close(&spare->fid), -FI_EBUSY);
	OK(fi_poll_del(set, &spare->fid, 0));
	OK(fi_poll_del(set, &spare->fid, 0)); /* not in the set: no error (libfabric's util) */
	OK(fi_close(&spare->fid));

	/* Three messages: each round reports the send CQ, the receive CQ and both counters
	 * (in the order they were added), and nothing once all is read. */
	for (int i = 0; i < 3; i++) {
		int tx = 0, rx = 0, ctx_tx = 0, ctx_rx = 0;

		OK(fi_trecv(p.ep[1], rbuf, sizeof rbuf, NULL, 0, 9, 0, (void *)(intptr_t)(10 + i)));
		posted++;
		fill(sbuf, 64, (uint8_t)i);
		RDM_POST(p.cq[0], p.cq[1],
			 fi_tsend(p.ep[0], sbuf, 64, NULL, 1, 9, (void *)(intptr_t)(20 + i)));
		while (!(tx && rx && ctx_tx && ctx_rx)) {
			n = poll_until(set, ctx, 8);
			for (int k = 0; k < n; k++) {
				if (ctx[k] == &p.cq[0]) {
					EXPECT(fi_cq_read(p.cq[0], &e, 1), 1);
					EXPECT(e.op_context, (void *)(intptr_t)(20 + i));
					tx++;
				} else if (ctx[k] == &p.cq[1]) {
					EXPECT(fi_cq_read(p.cq[1], &e, 1), 1);
					EXPECT(e.op_context, (void *)(intptr_t)(10 + i));
					check(rbuf, 64, (uint8_t)i);
					rx++;
					completed++;
				} else if (ctx[k] == &poll_cntr[0]) {
					EXPECT(fi_cntr_read(poll_cntr[0]), (uint64_t)i + 1);
					ctx_tx++;
				} else if (ctx[k] == &poll_cntr[1]) {
					EXPECT(fi_cntr_read(poll_cntr[1]), (uint64_t)i + 1);
					ctx_rx++;
				} else {
					FAIL("fi_poll reported an unknown context %p", ctx[k]);
				}
			}
		}
		EXPECT(tx + rx + ctx_tx + ctx_rx, 4); /* each reported once for its event */
		EXPECT(fi_poll(set, ctx, 8), 0);
	}
	OK(fi_poll_del(set, &p.cq[0]->fid, 0));
	OK(fi_poll_del(set, &poll_cntr[0]->fid, 0));
	OK(fi_poll_del(set, &poll_cntr[1]->fid, 0));

	/* An entry left unread is reported again at the next poll. */
	OK(fi_trecv(p.ep[1], rbuf, sizeof rbuf, NULL, 0, 9, 0, (void *)30));
	posted++;
	RDM_POST(p.cq[0], p.cq[1], fi_tsend(p.ep[0], sbuf, 64, NULL, 1, 9, (void *)31));
	n = poll_until(set, ctx, 8);
	TRUE(n == 1 && ctx[0] == &p.cq[1]);
	EXPECT(fi_poll(set, ctx, 8), 1);
	EXPECT(ctx[0], &p.cq[1]);
	EXPECT(fi_cq_read(p.cq[1], &e, 1), 1);
	EXPECT(e.op_context, (void *)30);
	completed++;
	EXPECT(fi_poll(set, ctx, 8), 0);
	EXPECT(completed, posted);
	/* The send's completion, read directly (its CQ left the set). */
	EXPECT(cq_wait(p.cq[0], (struct fi_cq_data_entry *)&e), 1);
	EXPECT(e.op_context, (void *)31);

	/* Closed with a member left: it is released (libfabric's util). */
	OK(fi_close(&set->fid));
	EXPECT(fi_poll(set, ctx, 8), -FI_EINVAL); /* a closed handle */
	for (int i = 0; i < 2; i++) {
		OK(fi_close(&p.ep[i]->fid));
		OK(fi_close(&p.av[i]->fid));
		OK(fi_close(&p.cq[i]->fid));
		OK(fi_close(&poll_cntr[i]->fid));
	}
	OK(fi_close(&p.domain->fid));
	OK(fi_close(&p.fabric->fid));
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok poll\n");
}

/* Wait sets (fi_wait_open, fi_wait): an RDM pair whose CQs and a receive counter wait on
 * one set; fi_wait sleeps until a message a thread sends 200 ms later arrives, and the
 * set's descriptor works as fabtests' -c fd waits on a CQ's (fi_trywait, then poll). */
static struct fid_cntr *wait_cntr;
static struct fid_wait *wait_set;

static void wait_pair_setup(struct rdm_pair *p, int i)
{
	struct fi_cntr_attr ca = {
		.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_SET, .wait_set = wait_set};

	if (i == 1) {
		OK(fi_cntr_open(p->domain, &ca, &wait_cntr, NULL));
		OK(fi_ep_bind(p->ep[1], &wait_cntr->fid, FI_RECV));
	}
}

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void wait_section(void)
{
	struct fi_info *h = rdm_hints(FI_MSG | FI_TAGGED), *info;
	struct fi_wait_attr wa = {.wait_obj = FI_WAIT_FD};
	struct fi_eq_attr ea = {.wait_obj = FI_WAIT_SET};
	struct fi_cq_attr qa = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_SET};
	struct fi_cq_tagged_entry e;
	struct fid_wait *bad;
	struct fid_fabric *wf;
	struct fid_cq *nowhere;
	struct fid_eq *eq;
	struct rdm_pair p;
	enum fi_wait_obj wo;
	uint8_t rbuf[64];
	pthread_t t;
	void *ret;
	double t0;
	int fd = -1, posted = 0, completed = 0;

	OK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &info));
	OK(fi_fabric(info->fabric_attr, &wf, NULL));
	wa.flags = 1;
	EXPECT(fi_wait_open(wf, &wa, &bad), -FI_EINVAL);
	wa.flags = 0;
	wa.wait_obj = FI_WAIT_NONE;
	EXPECT(fi_wait_open(wf, &wa, &bad), -FI_EINVAL);
	wa.wait_obj = FI_WAIT_MUTEX_COND;
	EXPECT(fi_wait_open(wf, &wa, &bad), -FI_ENOSYS); /* README: not implemented */
	wa.wait_obj = FI_WAIT_FD;
	OK(fi_wait_open(wf, &wa, &wait_set));
	OK(fi_control(&wait_set->fid, FI_GETWAITOBJ, &wo));
	EXPECT(wo, FI_WAIT_FD);
	OK(fi_control(&wait_set->fid, FI_GETWAIT, &fd));
	TRUE(fd >= 0);
	EXPECT(fi_eq_open(wf, &ea, &eq, NULL), -FI_EINVAL); /* FI_WAIT_SET, no set */
	ea.wait_set = wait_set;
	OK(fi_eq_open(wf, &ea, &eq, NULL));
	OK(fi_control(&eq->fid, FI_GETWAITOBJ, &wo));
	EXPECT(wo, FI_WAIT_SET);
	{
		struct fid *ef = &eq->fid;
		OK(fi_trywait(wf, &ef, 1)); /* no event: it may sleep */
	}
	EXPECT(fi_close(&wf->fid), -FI_EBUSY); /* the set and the EQ hold it */

	/* The pair (on a fabric of its own): its CQs and a receive counter in the set. */
	rdm_cq_wait = FI_WAIT_SET;
	rdm_cq_wait_set = wait_set;
	rdm_pair_setup = wait_pair_setup;
	rdm_pair_open(info, &p, 0);
	rdm_cq_wait = FI_WAIT_NONE;
	rdm_cq_wait_set = NULL;
	rdm_pair_setup = NULL;
	qa.wait_set = NULL;
	EXPECT(fi_cq_open(p.domain, &qa, &nowhere, NULL), -FI_EINVAL); /* FI_WAIT_SET, no set */
	qa.wait_set = (struct fid_wait *)&p.av[0]->fid;
	EXPECT(fi_cq_open(p.domain, &qa, &nowhere, NULL), -FI_EINVAL); /* not a wait set */
	OK(fi_control(&p.cq[0]->fid, FI_GETWAITOBJ, &wo));
	EXPECT(wo, FI_WAIT_SET);
	EXPECT(fi_cq_sread(p.cq[1], &e, 1, NULL, 0), -FI_EINVAL); /* fi_cq(3): wait on the set */
	EXPECT(fi_close(&wait_set->fid), -FI_EBUSY);

	/* Nothing happens: fi_wait times out, after its timeout. */
	t0 = now_ms();
	EXPECT(fi_wait(wait_set, 150), -FI_ETIMEDOUT);
	TRUE(now_ms() - t0 >= 140);

	/* Blocked in fi_wait before the message exists: woken for it. */
	for (int round = 0; round < 2; round++) {
		OK(fi_trecv(p.ep[1], rbuf, sizeof rbuf, NULL, FI_ADDR_UNSPEC, 0x55, 0,
			    (void *)(intptr_t)(50 + round)));
		posted++;
		EXPECT(pthread_create(&t, NULL, rdm_late_send, &p), 0);
		t0 = now_ms();
		for (;;) {
			ssize_t r;
			if (round == 0) {
				int w = fi_wait(wait_set, 10000);
				TRUE(w == 0);
			} else {
				/* As fabtests' -c fd: trywait on the set, then poll its descriptor. */
				struct fid *f = &wait_set->fid;
				struct pollfd pfd = {.fd = fd, .events = POLLIN};
				int tw = fi_trywait(p.fabric, &f, 1);
				TRUE(tw == 0 || tw == -FI_EAGAIN);
				if (tw == 0)
					TRUE(poll(&pfd, 1, 10000) == 1);
			}
			r = fi_cq_read(p.cq[1], &e, 1);
			if (r == 1)
				break;
			TRUE(r == -FI_EAGAIN);
			TRUE(now_ms() - t0 < 10000);
		}
		EXPECT(e.op_context, (void *)(intptr_t)(50 + round));
		EXPECT(e.len, 5);
		completed++;
		EXPECT(pthread_join(t, &ret), 0);
		EXPECT((intptr_t)ret, 0);
		EXPECT(fi_cntr_read(wait_cntr), (uint64_t)round + 1);
	}
	EXPECT(completed, posted);

	/* Its members closed, the set closes. */
	for (int i = 0; i < 2; i++) {
		OK(fi_close(&p.ep[i]->fid));
		OK(fi_close(&p.av[i]->fid));
		OK(fi_close(&p.cq[i]->fid));
	}
	OK(fi_close(&wait_cntr->fid));
	EXPECT(fi_close(&wait_set->fid), -FI_EBUSY); /* the EQ */
	OK(fi_close(&eq->fid));
	OK(fi_close(&wait_set->fid));
	EXPECT(fi_wait(wait_set, 0), -FI_EINVAL); /* a closed handle */
	OK(fi_close(&p.domain->fid));
	OK(fi_close(&p.fabric->fid));
	OK(fi_close(&wf->fid));
	fi_freeinfo(info);
	fi_freeinfo(h);
	printf("ok wait\n");
}

int main(int argc, char **argv)
{
	const char *only = argc > 1 ? argv[1] : NULL;
	setvbuf(stdout, NULL, _IONBF, 0);
	if (!only || !strcmp(only, "msg")) {
		msg_section();
		pep_address_section();
		cq_overrun_section();
	}
	if (!only || !strcmp(only, "dgram"))
		dgram_section();
	if (!only || !strcmp(only, "bad"))
		bad_section();
	if (!only || !strcmp(only, "handles"))
		handle_section();
	if (!only || !strcmp(only, "hints")) {
		hints_section();
		getinfo_rules_section();
	}
	if (!only || !strcmp(only, "rdm")) {
		rdm_section();
		rdm_listener_section();
	}
	if (!only || !strcmp(only, "rdm-mr-cache"))
		rdm_mr_cache_section();
	if (!only || !strcmp(only, "rma"))
		rma_section();
	if (!only || !strcmp(only, "rdm-rma"))
		rdm_rma_section();
	if (!only || !strcmp(only, "rdm-atomic"))
		rdm_atomic_section();
	if (!only || !strcmp(only, "cntr"))
		cntr_section();
	if (!only || !strcmp(only, "poll"))
		poll_section();
	if (!only || !strcmp(only, "wait"))
		wait_section();
	if (only && !strcmp(only, "peer"))
		peer_section(argv[0]);
	if (only && !strcmp(only, "shm-send") && argc > 2)
		shm_send_section(argv[2]);
	if (only && !strcmp(only, "transfer"))
		transfer_section();
	if (only && !strcmp(only, "rdm-transfer"))
		rdm_transfer_section();
	return 0;
}
