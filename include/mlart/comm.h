/* mlart — ranks and their collectives (decode-context parallel, docs/dcp.md).
 *
 * A communicator joins the ranks of one DCP group.  Two implementations
 * share one interface and one protocol:
 *   local  the ranks are threads of one process (CPU buffers, or CUDA
 *          buffers of one process); for tests and for running a group on
 *          one device.  Its collectives block the calling thread, synchronise
 *          the stream first and so cannot be captured in a CUDA graph.
 *   nccl   one rank a process (mpirun), NCCL collectives enqueued on the
 *          caller's stream; capturable.  libnccl.so.2 is opened when the
 *          first NCCL id or communicator is made; the NCCL unique id travels
 *          through a TCP rendezvous served by rank 0 (include/mlart/rendezvous.h).
 * Every wait for a peer to arrive has a deadline: a dead or hung peer ends
 * in MLART_ETIMEDOUT (or MLART_ECOMM) on every surviving rank, never a hang.
 * (The local group then still waits, without one, for peers that have
 * arrived to finish reading this rank's buffers: see below.)  An NCCL
 * collective returns once enqueued and its peers meet on the device, so wait
 * for a stream that carries NCCL work with mlart_comm_wait, not with
 * cudaStreamSynchronize, which a dead peer would block for ever.
 *
 * Collectives are called by every rank of the group, in the same order.
 * Buffers live where the communicator's device says (-1: host memory).
 */
#ifndef MLART_COMM_H
#define MLART_COMM_H

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_comm mlart_comm;

/* ---- where this process is in its launch ------------------------------ */

typedef struct mlart_rank_info {
    int32_t rank, size;  /* world rank and size; 0 and 1 when nothing is set */
    int32_t local_rank;  /* rank on this host (picks the CUDA device); 0 when unknown */
    char source[32];     /* which variables gave them: "MLART", "OMPI", "PMI", "RANK" or "" */
} mlart_rank_info;

/* Rank and size from the environment, first found of: MLART_RANK /
 * MLART_WORLD_SIZE (MLART_LOCAL_RANK), OMPI_COMM_WORLD_RANK / _SIZE /
 * _LOCAL_RANK, PMI_RANK / PMI_SIZE (MPI_LOCALRANKID), RANK / WORLD_SIZE
 * (LOCAL_RANK).  Nothing set: rank 0 of 1.  MLART_ECONFIG naming the
 * variable when a value is not a number or rank >= size.  A later family
 * set to another rank or size (left over from another launch) is named in
 * a warning on the library's log. */
MLART_API int mlart_rank_from_env(mlart_rank_info *out);

/* ---- communicators ----------------------------------------------------- */

/* A local group: `size` ranks that are threads of this process, on `device`
 * (-1 host, else a CUDA ordinal, MLART_ENOTSUP in a build without CUDA; a
 * rank may also use another device, its copies go through unified
 * addressing).  timeout_ms (0: 60000) bounds every
 * wait for the other ranks to arrive at a collective: past it the call
 * returns MLART_ETIMEDOUT and the group stays failed (every later collective
 * returns it at once).  Once all ranks have arrived, a collective returns
 * only after every rank has finished reading this rank's buffers, however
 * long that takes (a warning is logged past timeout_ms), so the caller may
 * reuse them at once; a rank whose own copy failed returns its error and
 * still does not hold up the others.  Destroying a rank's communicator
 * fails the group as a timeout does, at once: the other ranks' collectives
 * then return MLART_ECOMM naming that rank instead of waiting out the
 * timeout for a rank that gave up.  Create the group once, then one
 * communicator per rank (a second for a rank, even after the first was
 * destroyed, is refused with MLART_EINVAL); destroy the communicators (after the last
 * collective) before the group (a group destroyed first is freed, with a
 * warning, when its last communicator is).  Every rank of a collective must
 * make the same call (the same collective, sizes and counts): one that
 * differs fails on every rank with MLART_ECOMM naming the rank, and no
 * buffer is read or written. */
typedef struct mlart_comm_group mlart_comm_group;
MLART_API int mlart_comm_group_create(int size, int device, int timeout_ms,
                                      mlart_comm_group **out);
MLART_API void mlart_comm_group_destroy(mlart_comm_group *group);
MLART_API int mlart_comm_local_create(mlart_comm_group *group, int rank, mlart_comm **out);

/* NCCL.  Rank 0 of the group makes the unique id (MLART_NCCL_ID_BYTES
 * opaque bytes); every rank passes the same id to mlart_comm_nccl_create
 * for `rank` of `size` on CUDA `device`, which returns once the group is
 * joined or timeout_ms (0: 60000) has passed (MLART_ETIMEDOUT; the half-made
 * communicator is aborted).  A later call that NCCL leaves in progress is
 * polled for at most 60 s (MLART_ETIMEDOUT; the communicator is then
 * aborted when it is destroyed); the collectives' work on the device is
 * waited for by mlart_comm_wait.  The id may travel by any means; programs link
 * libmlart_rendezvous.a for mlart_comm_nccl_join (include/mlart/rendezvous.h),
 * which does all three steps over TCP.  MLART_ENOTSUP in a build without
 * CUDA; MLART_ECOMM when libnccl.so.2 cannot be opened or is older than 2.18
 * (the message says which). */
#define MLART_NCCL_ID_BYTES 128
MLART_API int mlart_comm_nccl_unique_id(void *id, size_t bytes);
MLART_API int mlart_comm_nccl_create(int rank, int size, int device, const void *id, size_t bytes,
                                     int timeout_ms, mlart_comm **out);

/* Accepts NULL.  An NCCL communicator with work in flight is aborted. */
MLART_API void mlart_comm_destroy(mlart_comm *comm);
MLART_API int mlart_comm_rank(const mlart_comm *comm);
MLART_API int mlart_comm_size(const mlart_comm *comm);
/* -1 host, else the CUDA ordinal of the rank's buffers. */
MLART_API int mlart_comm_device(const mlart_comm *comm);
/* 1 when the collectives may be captured in a CUDA graph (nccl). */
MLART_API int mlart_comm_graph_safe(const mlart_comm *comm);
/* "local" or "nccl"; "none" for NULL. */
MLART_API const char *mlart_comm_kind(const mlart_comm *comm);

/* recv holds size blocks of `bytes`: block r is rank r's send. */
MLART_API int mlart_comm_all_gather(mlart_comm *comm, const void *send, void *recv, size_t bytes,
                                    void *stream);
/* send and recv hold size blocks of `bytes`: send's block d goes to rank d,
 * recv's block s came from rank s. */
MLART_API int mlart_comm_all_to_all(mlart_comm *comm, const void *send, void *recv, size_t bytes,
                                    void *stream);
/* n all-to-alls in one operation (one NCCL launch): array i as above with
 * send[i], recv[i] and bytes[i]; arrays of 0 bytes are left out.  n in 1..8. */
MLART_API int mlart_comm_all_to_all_n(mlart_comm *comm, int n, const void *const *send,
                                      void *const *recv, const size_t *bytes, void *stream);
/* send holds size blocks of n floats; recv (n floats) gets the sum over
 * ranks of their block `rank`. */
MLART_API int mlart_comm_reduce_scatter_f32(mlart_comm *comm, const float *send, float *recv,
                                            size_t n, void *stream);

/* Wait until the work enqueued on `stream` (of the communicator's device)
 * so far has ended, at most timeout_ms (0: 60000); 0 when it has.  An NCCL
 * communicator's kernels wait on the device for their peers, for ever if a
 * peer died or hangs: this polls the stream and NCCL's own error state
 * instead, and past the deadline (MLART_ETIMEDOUT) or on an error NCCL
 * reports (MLART_ECOMM: a peer closed its connection, a network error) it
 * aborts the communicator (ncclCommAbort, which ends its kernels so the
 * stream drains, and returns once the device has: so a stream held by other
 * work that never ends still holds this call); every later collective and
 * wait on it then returns MLART_ECOMM at once, and it is only fit to be
 * destroyed.  A local group's
 * collectives have ended when they return: on a device this only waits for
 * the stream against the deadline (MLART_ETIMEDOUT, the group untouched);
 * on the host it returns 0.  MLART_ECUDA when the stream reports an error.
 * Whatever else is on the stream is waited for too, and a timeout leaves it
 * running. */
MLART_API int mlart_comm_wait(mlart_comm *comm, void *stream, int timeout_ms);

/* ---- where a cached token lives under DCP ------------------------------ */

/* Interleave I: logical position p of a request lives on rank (p / I) % size
 * at local position (p / (I*size)) * I + p % I (docs/dcp.md; I = 1: rank
 * p % size, local p / size); an interleave of 0 (or less) counts as 1, as
 * the layer descriptor's dcp_interleave 0 does. */
MLART_API int32_t mlart_dcp_owner(int64_t pos, int32_t size, int32_t interleave);
MLART_API int64_t mlart_dcp_local_pos(int64_t pos, int32_t size, int32_t interleave);
/* Positions 0..seq_len-1 that live on `rank`. */
MLART_API int64_t mlart_dcp_local_len(int64_t seq_len, int32_t rank, int32_t size,
                                      int32_t interleave);

#ifdef __cplusplus
}
#endif
#endif /* MLART_COMM_H */
