/* The guard-page harness around cuBLAS strided-batched GEMM on the same
 * strided views the query absorption takes (q_nope [H,T,P] inside q
 * [T,H,P+R], output into q_mqa [T,H,L+R]), with CUBLAS_COMPUTE_32F and
 * CUBLAS_COMPUTE_32F_PEDANTIC.  Each operand in turn ends exactly at the end
 * of its mapping.  A fault here is a finding about cuBLAS, recorded and
 * printed, not a failure: the test fails only when the harness cannot run
 * or cannot tell what happened.
 *
 * A fault ends the CUDA context, so the probes run in child processes; the
 * parent never initialises CUDA (a forked child cannot use a parent's
 * context).  A child runs probes from a given index on and records each
 * result in shared memory; after a fault the parent starts a new child at
 * the next probe. */
#define _DEFAULT_SOURCE /* fork, mmap flags */
#include <check.h>
#include <cublas_v2.h>
#include <sys/mman.h>

#include "guard_alloc.h"
#include "ops/ops.h"
#include "ops_gpu_util.h"

enum { PL_Q, PL_W, PL_OUT, PL_COUNT };
static const char *const k_pl[] = {"q_nope view", "W_UK_T", "out view"};
static const int64_t k_H[] = {16, 128};
static const int64_t k_T[] = {1, 4, 16, 64, 256};
#define NPROBE (PL_COUNT * 2 * 5 * 2 * 2)

enum { P_PENDING = 0, P_RUNNING, P_OK, P_FAULT, P_DIED, P_SETUP };
typedef struct probe_result {
    int state;
    int cuda_err;      /* cudaError_t of the synchronisation after the GEMM */
    double max_rel;    /* max |cublas - ours| / max |ours| when it ran */
} probe_result;

typedef struct probe {
    int pl, pedantic;
    int64_t H, T, P;
} probe;

static probe k_probes[NPROBE];
static probe_result *g_res; /* shared with the children */
static uint64_t g_seed;

static void make_probes(void)
{
    int n = 0;
    for (int pl = 0; pl < PL_COUNT; pl++)
        for (int ih = 0; ih < 2; ih++)
            for (int it = 0; it < 5; it++)
                for (int p = 0; p < 2; p++)
                    for (int ped = 0; ped < 2; ped++)
                        k_probes[n++] = (probe){pl, ped, k_H[ih], k_T[it], p ? 192 : 128};
}

/* Child: probes from `start` on; returns only through _exit. */
static void child(int start)
{
    cublasHandle_t hb;
    uint64_t rng = g_seed ^ (uint64_t)start;
    if (mlart_guard_init(0) != 0 || cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS) {
        g_res[start].state = P_SETUP;
        _exit(2);
    }
    for (int i = start; i < NPROBE; i++) {
        const probe *p = &k_probes[i];
        ops_case c = {0, p->H, p->T, p->P, 512, 64, 0, 0, 0};
        const size_t na = ops_a_elems(&c), nw = ops_w_elems(&c), nc = ops_c_elems(&c);
        const size_t sa = (size_t)((c.T * c.H - 1) * ops_as(&c) + c.K) * 2;
        const size_t sc = (size_t)((c.T * c.H - 1) * ops_cs(&c) + c.N) * 2;
        uint16_t *ha = malloc(na * 2), *hw = malloc(nw * 2), *h1 = malloc(sc), *h2 = malloc(sc);
        uint16_t *da, *dw, *dc, *ours, *pa, *pw, *pc;
        mlart_guard_buf ga = {0}, gw = {0}, gc = {0};
        const float alpha = 1.f, beta = 0.f;
        cublasStatus_t bs;
        cudaError_t e;
        ops_views v;
        double mx = 0, md = 0;
        g_res[i].state = P_RUNNING;
        if (!ha || !hw || !h1 || !h2)
            _exit(3);
        ops_fill_bf16(ha, na, &rng);
        ops_fill_bf16(hw, nw, &rng);
        if (cudaMalloc((void **)&da, na * 2) || cudaMalloc((void **)&dw, nw * 2) ||
            cudaMalloc((void **)&dc, nc * 2) || cudaMalloc((void **)&ours, nc * 2))
            _exit(4);
        cudaMemcpy(da, ha, na * 2, cudaMemcpyHostToDevice);
        cudaMemcpy(dw, hw, nw * 2, cudaMemcpyHostToDevice);
        pa = da;
        pw = dw;
        pc = dc;
        if (p->pl == PL_Q) {
            if (mlart_guard_alloc(&ga, sa, 0))
                _exit(5);
            pa = ga.ptr;
            cudaMemcpy(pa, ha, sa, cudaMemcpyHostToDevice);
        } else if (p->pl == PL_W) {
            if (mlart_guard_alloc(&gw, nw * 2, 0))
                _exit(5);
            pw = gw.ptr;
            cudaMemcpy(pw, hw, nw * 2, cudaMemcpyHostToDevice);
        } else {
            if (mlart_guard_alloc(&gc, sc, 0))
                _exit(5);
            pc = gc.ptr;
        }
        /* our op on ordinary storage: the values cuBLAS should produce */
        v = ops_make_views(&c, 0, da, na * 2, dw, nw * 2, ours, nc * 2);
        if (mlart_query_bmm_cuda(&v.a, &v.w, &v.c, NULL, NULL, 0) != 0 || cudaDeviceSynchronize() != cudaSuccess)
            _exit(6);
        cudaMemset(pc, 0, sc);
        cudaDeviceSynchronize();
        bs = cublasGemmStridedBatchedEx(hb, CUBLAS_OP_N, CUBLAS_OP_N, (int)c.N, (int)c.T, (int)c.K, &alpha, pw,
                                        CUDA_R_16BF, (int)c.N, c.K * c.N, pa, CUDA_R_16BF, (int)(c.H * ops_as(&c)),
                                        ops_as(&c), &beta, pc, CUDA_R_16BF, (int)(c.H * ops_cs(&c)), ops_cs(&c),
                                        (int)c.H, p->pedantic ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT);
        e = cudaDeviceSynchronize();
        if (bs != CUBLAS_STATUS_SUCCESS && e == cudaSuccess)
            e = cudaErrorUnknown;
        g_res[i].cuda_err = (int)e;
        if (e != cudaSuccess) {
            g_res[i].state = P_FAULT;
            _exit(10); /* the context is gone; the parent goes on with i + 1 */
        }
        cudaMemcpy(h1, ours, sc, cudaMemcpyDeviceToHost);
        cudaMemcpy(h2, pc, sc, cudaMemcpyDeviceToHost);
        for (int64_t r = 0; r < c.T * c.H; r++)
            for (int64_t n = 0; n < c.N; n++) {
                size_t k = (size_t)(r * ops_cs(&c) + n);
                double x = mlart_bf16_to_f32(h1[k]), y = mlart_bf16_to_f32(h2[k]);
                mx = fabs(x) > mx ? fabs(x) : mx;
                md = fabs(x - y) > md || isnan(y) ? (isnan(y) ? INFINITY : fabs(x - y)) : md;
            }
        g_res[i].max_rel = md / (mx > 0 ? mx : 1);
        g_res[i].state = P_OK;
        mlart_guard_free(&ga);
        mlart_guard_free(&gw);
        mlart_guard_free(&gc);
        cudaFree(da);
        cudaFree(dw);
        cudaFree(dc);
        cudaFree(ours);
        free(ha);
        free(hw);
        free(h1);
        free(h2);
    }
    cublasDestroy(hb);
    _exit(0);
}

static int print_probe(int i)
{
    const probe *p = &k_probes[i];
    const int st = g_res[i].state;
    ck_assert_msg(st == P_OK || st == P_FAULT || st == P_DIED, "probe %d has no result", i);
    if (st == P_OK)
        printf("%-12s %5lld %5lld %4lld %-9s %-8s %.3g\n", k_pl[p->pl], (long long)p->H, (long long)p->T,
               (long long)p->P, p->pedantic ? "PEDANTIC" : "32F", "ok", g_res[i].max_rel);
    else
        printf("%-12s %5lld %5lld %4lld %-9s %-8s %s\n", k_pl[p->pl], (long long)p->H, (long long)p->T, (long long)p->P,
               p->pedantic ? "PEDANTIC" : "32F", st == P_FAULT ? "FAULT" : "died",
               st == P_FAULT ? cudaGetErrorName((cudaError_t)g_res[i].cuda_err) : "(killed mid-probe)");
    fflush(stdout);
    return st != P_OK;
}

START_TEST(cublas_probes)
{
    int next = 0, printed = 0, children = 0, faults = 0;
    make_probes();
    g_res = mmap(NULL, sizeof(probe_result) * NPROBE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ck_assert(g_res != MAP_FAILED);
    memset(g_res, 0, sizeof(probe_result) * NPROBE);
    printf("cuBLAS strided-batched BF16 (cublasGemmStridedBatchedEx, CUBLAS_GEMM_DEFAULT), one operand ending at a "
           "guard page; L=512, R=64\n");
    printf("%-12s %5s %5s %4s %-9s %-8s %s\n", "guarded", "H", "T", "P", "compute", "result",
           "max|cublas-ours|/max|ours|");
    while (next < NPROBE) {
        int status = 0;
        pid_t pid;
        fflush(stdout);
        pid = fork();
        ck_assert(pid >= 0);
        if (pid == 0)
            child(next);
        children++;
        ck_assert(waitpid(pid, &status, 0) == pid);
        ck_assert_msg(g_res[next].state != P_SETUP, "probe child could not set up (guard pages or cuBLAS)");
        ck_assert_msg(g_res[next].state != P_PENDING, "probe child exited (status %#x) before probe %d", status, next);
        while (next < NPROBE && g_res[next].state != P_PENDING && g_res[next].state != P_RUNNING)
            next++;
        if (next < NPROBE && g_res[next].state == P_RUNNING) {
            ck_assert_msg(!WIFEXITED(status) || WEXITSTATUS(status) < 3 || WEXITSTATUS(status) > 6,
                          "probe %d: setup failed in the child (exit %d)", next, WEXITSTATUS(status));
            g_res[next].state = P_DIED; /* killed mid-probe: record and go on */
            next++;
        }
        for (; printed < next; printed++)
            faults += print_probe(printed);
    }
    printf("cuBLAS guard probes: %d of %d faulted or died, %d child processes (a finding about cuBLAS, not a failure "
           "of mlart)\n",
           faults, NPROBE, children);
    munmap(g_res, sizeof(probe_result) * NPROBE);
}
END_TEST

int main(void)
{
    Suite *s;
    TCase *tc;
    if (gpu_test_begin("ops_guard_cublas", &g_seed))
        return 77;
    s = suite_create("ops_guard_cublas");
    tc = tcase_create("cublas");
    tcase_set_timeout(tc, 500);
    tcase_add_test(tc, cublas_probes);
    suite_add_tcase(s, tc);
    return check_run(s, CK_NOFORK); /* this process forks its own CUDA children */
}
