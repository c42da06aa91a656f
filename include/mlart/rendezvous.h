/* mlart — the TCP rendezvous of a launch's ranks (DESIGN 7), in the static
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

/* Hand `bytes` of `blob` from rank 0 to ranks 1..size-1 over TCP (libuv).
 * Rank 0 listens on addr:port (addr a numeric IPv4 address; "0.0.0.0" for
 * every interface) and serves each of the size-1 peers once; the others
 * connect to addr:port, retrying every 50 ms until rank 0 listens, and
 * receive the blob into `blob`.  Each peer first says its rank and the group
 * size; rank 0 refuses a peer whose size differs or whose rank was seen
 * already, and keeps waiting for valid ones.  bytes <= 1 MiB.  timeout_ms
 * (0: 60000) bounds the whole exchange: MLART_ETIMEDOUT when it passes (rank
 * 0 says how many peers came), MLART_ECOMM on a refused or broken
 * connection.  size 1: nothing to do. */
MLART_API int mlart_rendezvous(const char *addr, int port, int rank, int size, void *blob,
                               size_t bytes, int timeout_ms);

/* An NCCL communicator for `rank` of `size` on CUDA `device`: rank 0 makes
 * the unique id, mlart_rendezvous(addr, port, ...) hands it out, every rank
 * then calls mlart_comm_nccl_create with the time left of timeout_ms
 * (0: 60000; at least 1 s). */
MLART_API int mlart_comm_nccl_join(int rank, int size, int device, const char *addr, int port,
                                   int timeout_ms, mlart_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* MLART_RENDEZVOUS_H */
