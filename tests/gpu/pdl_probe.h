/* Probes for programmatic dependent launch (PDL) in the GPU tests.
 *
 * A kernel launched with PDL may start before the previous kernel of its
 * stream ends; it must wait (griddepcontrol.wait) before it reads what that
 * kernel writes.  pdl_late_copy is a previous kernel that lets dependents
 * start at once, then spins for spin_us and only then copies src to dst: a
 * dependent that reads dst without waiting sees the old bytes.
 * pdl_nowait_copy is such a careless dependent (PDL launch, no wait), the
 * control that shows the early start really happens on this device.  Both
 * return a cudaError_t; bytes must be a multiple of 16.  Use a non-blocking
 * stream: a stream that synchronises with the legacy default stream may
 * not start dependents early. */
#ifndef MLART_TESTS_PDL_PROBE_H
#define MLART_TESTS_PDL_PROBE_H

#include <cuda_runtime.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

int pdl_late_copy(void *dst, const void *src, size_t bytes, unsigned spin_us, cudaStream_t st);
int pdl_nowait_copy(void *dst, const void *src, size_t bytes, cudaStream_t st);
/* The control on stream st (a non-blocking stream), eagerly or (graph 1)
 * from a captured graph: 1 if the careless dependent read old bytes (it
 * started before the late writer finished, so a missing wait would show),
 * 0 if it read only new ones, -1 on a CUDA error. */
int pdl_control(cudaStream_t st, int graph);
/* Fork and join: on a second stream a late writer K (spin_side_us) runs
 * beside a late writer A on st (spin_main_us); st waits for K by an event,
 * then a careless dependent is launched on st with PDL.  graph 0: eagerly;
 * 1: captured and replayed; 2: captured with the capture's dependencies set
 * by hand before the dependent (a programmatic edge from A, a full one from
 * K) and the dependent launched without the PDL attribute.  *early_main: it
 * read old bytes of A (it started before A finished: the programmatic edge
 * to A survived the join); *early_side: it read old bytes of K (it started
 * before K finished: the join did not hold it); *prog_edges: programmatic
 * edges in the captured graph.  0, or -1 on a CUDA error. */
int pdl_fork_join(cudaStream_t st, int graph, unsigned spin_main_us, unsigned spin_side_us,
                  int *early_main, int *early_side, int *prog_edges);

#ifdef __cplusplus
}
#endif
#endif
