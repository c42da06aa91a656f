/* mlart — the TCP rendezvous of a launch's ranks (docs/dcp.md), in the static
 * library libmlart_rendezvous.a, which a program links beside libmlart
 * (it carries libuv; Debian's libuv archive is not position-independent, so
 * this part cannot live in libmlart.so).
 */
#ifndef MLART_RENDEZVOUS_H
#define MLART_RENDEZVOUS_H

#include "mlart/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest group mlart_rendezvous takes. */
#define MLART_RENDEZVOUS_MAX_RANKS 65536

/* Hand `bytes` of `blob` from rank 0 to ranks 1..size-1 over TCP (libuv).
 * Rank 0 listens on addr:port (addr a numeric IPv4 address; "0.0.0.0" for
 * every interface) and serves each of the size-1 peers once; the others
 * connect to addr:port, retrying every 50 ms until rank 0 listens, and
 * receive the blob into `blob` (a connect that meets itself, as one to a free
 * port of the local ephemeral range can, counts as not answered).  Each peer
 * first says its rank, the group size and `bytes`; rank 0 refuses a peer
 * whose group size differs or whose rank was served already, and keeps
 * waiting for valid ones.  A rank of the group whose `bytes` differs from
 * rank 0's (another build or config) is refused, and from then on rank 0
 * serves no further peer: it answers each later one that it gave up, naming
 * that rank and both sizes, and returns MLART_ECOMM naming them too once
 * every other rank has been served or told (so at once when all are there) or
 * at the deadline (then also naming the ranks neither served nor told); ranks
 * sent the blob before it came return 0.  A peer that has the whole blob
 * acknowledges it with the blob's checksum and returns 0 once that is sent;
 * rank 0 counts a rank served only on an acknowledgement whose checksum is
 * that of its blob, and returns 0 when all are.  A peer that leaves (or errs,
 * or acknowledges other bytes) before acknowledging the blob frees its rank
 * for a later connection, so a crashed or restarted process does not take the
 * rank of the one that comes next; while a rank waits for its
 * acknowledgement, another peer saying that rank is told to retry, and does
 * so every 50 ms.  Both sides must be of this version (the wire protocol's 3,
 * which added the blob size to a peer's first message and the checksum to its
 * acknowledgement; runtime/rendezvous/rendezvous.c describes the messages):
 * rank 0 answers a peer of another version with a refusal naming its own (a
 * rank 0 of version 2 closes on a peer of 3 without answering).
 * bytes <= 1 MiB.  timeout_ms (0: 60000) bounds the whole exchange: MLART_ETIMEDOUT when
 * it passes (rank 0 names the ranks not served and which of them await an
 * acknowledgement), MLART_ECOMM on a refused or broken connection, a blob
 * size that differs (on rank 0 and on every rank told) or an acknowledgement
 * that could not be sent.  size 1: nothing to do; size past
 * MLART_RENDEZVOUS_MAX_RANKS: MLART_EINVAL. */
MLART_API int mlart_rendezvous(const char *addr, int port, int rank, int size, void *blob,
                               size_t bytes, int timeout_ms);

/* An NCCL communicator for `rank` of `size` on CUDA `device`: rank 0 makes
 * the unique id, mlart_rendezvous(addr, port, ...) hands it out, every rank
 * then calls mlart_comm_nccl_create with the time left of timeout_ms
 * (0: 60000; at least 1 s).  A rank 0 that cannot make the id (no NCCL)
 * hands out its reason instead and returns its error; the other ranks then
 * return MLART_ECOMM quoting it, at once rather than at the deadline. */
MLART_API int mlart_comm_nccl_join(int rank, int size, int device, const char *addr, int port,
                                   int timeout_ms, mlart_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* MLART_RENDEZVOUS_H */
