/* Layer: the backend's layout contract reaches the layer and is enforced —
 * the exact split-and-transpose q_nope a CONTIGUOUS backend receives, the
 * strided view a SAFE_OP backend receives, dense weights kept at their
 * address, strided ones replaced by a dense copy, tail padding, output
 * layouts — and every bad input is refused before anything is written. */
#define _POSIX_C_SOURCE 200809L
#include <check.h>
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_run.h"
#include "mlart/backend.h"
#include "plugins/testhost.h"
#include "runtime/status.h"
#include "tests/runtime/fixture.h"

enum { H_ = 4, P_ = 16, R_ = 8, L_ = 32, V_ = 16, K_ = 24, PAGE_ = 4, T_ = 5, B_ = 3, MB_ = 6 };

static fx f;
static mlart_context *ctx;

static void setup(void)
{
    uint64_t seed = fx_seed();
    setenv("MLART_BACKEND_PATH", MLART_TEST_PLUGIN_DIR, 1);
    fx_init(&f, H_, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, seed);
    printf("seed %llu\n", (unsigned long long)seed);
    ck_assert_int_eq(mlart_context_create(-1, &ctx), 0);
}

static void teardown(void)
{
    mlart_context_destroy(ctx);
    fx_free(&f);
}

/* What module `name` recorded (it is loaded already by the layer). */
static testhost_record *record_of(const char *name)
{
    char path[512];
    void *h;
    testhost_record_fn get;
    snprintf(path, sizeof path, "%s/libmlart-backend-%s.so", MLART_TEST_PLUGIN_DIR, name);
    h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    ck_assert_msg(h != NULL, "module %s not loaded", name);
    *(void **)&get = dlsym(h, "testhost_record_get");
    ck_assert_ptr_nonnull(get);
    dlclose(h); /* drops only our extra reference */
    return get();
}

static void poison(void)
{
    memset(f.o, 0xff, sizeof(uint16_t) * T_ * H_ * V_); /* bf16 NaN */
    memset(f.lse, 0xff, sizeof(float) * H_ * T_);
}

static void no_nan(void)
{
    for (int i = 0; i < T_ * H_ * V_; i++)
        ck_assert_msg(!isnan(mlart_bf16_to_f32(f.o[i])), "o[%d] is NaN", i);
    for (int i = 0; i < H_ * T_; i++)
        ck_assert_msg(!isnan(f.lse[i]), "lse[%d] is NaN", i);
}

static mlart_layer *make(const char *backend)
{
    mlart_layer_desc d = fx_desc(&f, backend);
    mlart_layer *ly = NULL;
    int rc = mlart_layer_create(ctx, &d, &ly);
    ck_assert_msg(rc == 0, "create %s: %s", backend, mlart_last_error());
    return ly;
}

static void decode_ok(mlart_layer *ly, mlart_step_io *io)
{
    poison();
    ck_assert_msg(mlart_layer_decode(ly, io, NULL) == 0, "decode: %s", mlart_last_error());
    no_nan();
}

START_TEST(contract_reaches_layer)
{
    mlart_layer *ly = make("testhost");
    const mlart_layout_contract *c = mlart_layer_contract(ly);
    testhost_record *rec = record_of("testhost");
    ck_assert_str_eq(mlart_layer_backend_name(ly), "testhost");
    ck_assert_uint_eq(c->query_bmm, MLART_QBMM_CONTIGUOUS);
    ck_assert_uint_eq(c->output, MLART_OUT_HEAD_MAJOR);
    ck_assert_uint_eq(c->max_heads, 8);
    ck_assert_uint_eq(c->head_multiple, 2);
    ck_assert_uint_eq(c->max_topk, 64);
    ck_assert_int_eq(rec->creates, 1);
    ck_assert_int_eq(rec->plans, 1);
    ck_assert_int_eq(rec->init.device, -1);
    ck_assert_int_eq(rec->init.geom.heads, H_);
    ck_assert_ptr_nonnull(rec->init.error);
    ck_assert_int_eq(rec->plan.max_tokens, T_);
    ck_assert_int_eq(rec->plan.max_requests, B_);
    ck_assert_int_eq(rec->plan.max_blocks_per_req, MB_);
    ck_assert_int_eq(rec->plan.num_slots, f.num_slots);
    mlart_layer_destroy(ly);
    ck_assert_int_eq(rec->destroys, 1);
}
END_TEST

START_TEST(contiguous_query_is_exact_split_transpose)
{
    mlart_layer *ly = make("testhost");
    mlart_step_io io = fx_io(&f);
    testhost_record *rec = record_of("testhost");
    const mlart_step *s = &rec->step;
    decode_ok(ly, &io);
    ck_assert_int_eq(rec->attends, 1);
    ck_assert_int_eq(rec->q_nope_count, H_ * T_ * P_);
    /* the dense buffer it got: [H,T,P] with strides (T*P, P, 1), not q's storage */
    ck_assert_ptr_ne(s->q_nope.data, f.q);
    ck_assert_int_eq(s->q_nope.shape[0], H_);
    ck_assert_int_eq(s->q_nope.shape[1], T_);
    ck_assert_int_eq(s->q_nope.shape[2], P_);
    ck_assert_int_eq(s->q_nope.stride[0], T_ * P_);
    ck_assert_int_eq(s->q_nope.stride[1], P_);
    ck_assert_int_eq(s->q_nope.stride[2], 1);
    ck_assert_int_eq(mlart_tensor_check(&s->q_nope, "q_nope"), 0);
    for (int h = 0; h < H_; h++)
        for (int t = 0; t < T_; t++)
            ck_assert_mem_eq(rec->q_nope + (h * T_ + t) * P_, f.q + (t * H_ + h) * (P_ + R_),
                             P_ * sizeof(uint16_t));
    /* q_pe stays a view of q; outputs and workspace in the runtime's buffers */
    ck_assert_ptr_eq(s->q_pe.data, f.q + P_);
    ck_assert_int_eq(s->q_pe.stride[0], H_ * (P_ + R_));
    ck_assert_int_eq(s->q_pe.stride[1], P_ + R_);
    ck_assert_int_eq(s->attn_out.shape[0], H_); /* head-major */
    ck_assert_int_eq(s->attn_out.shape[1], T_);
    ck_assert_int_eq(s->q_mqa.shape[2], L_ + R_);
    ck_assert_ptr_nonnull(s->workspace);
    ck_assert_uint_eq(s->workspace_bytes, K_ * sizeof(float));
    ck_assert_ptr_eq(s->o.data, f.o);
    ck_assert_ptr_eq(s->lse.data, f.lse); /* dense lse goes straight to the backend */
    printf("CONTIGUOUS: q_nope [%d,%d,%d] materialised byte-exact\n", H_, T_, P_);
    mlart_layer_destroy(ly);
}
END_TEST

START_TEST(safe_op_gets_strided_view)
{
    mlart_layer *a = make("testhost"), *b = make("testsafe");
    mlart_step_io io = fx_io(&f);
    testhost_record *rec = record_of("testsafe");
    const mlart_step *s = &rec->step;
    uint16_t *o_contig = malloc(sizeof(uint16_t) * T_ * H_ * V_);
    float *lse_contig = malloc(sizeof(float) * H_ * T_);
    decode_ok(a, &io);
    memcpy(o_contig, f.o, sizeof(uint16_t) * T_ * H_ * V_);
    memcpy(lse_contig, f.lse, sizeof(float) * H_ * T_);
    decode_ok(b, &io);
    ck_assert_ptr_eq(s->q_nope.data, f.q);
    ck_assert_ptr_eq(s->q_nope.base, f.q);
    ck_assert_uint_eq(s->q_nope.extent, io.q.extent);
    ck_assert_int_eq(s->q_nope.stride[0], P_ + R_);
    ck_assert_int_eq(s->q_nope.stride[1], H_ * (P_ + R_));
    ck_assert_int_eq(s->q_nope.stride[2], 1);
    ck_assert_int_eq(s->attn_out.shape[0], T_); /* token-major */
    ck_assert_int_eq(s->attn_out.shape[1], H_);
    for (int h = 0; h < H_; h++)
        for (int t = 0; t < T_; t++)
            ck_assert_mem_eq(rec->q_nope + (h * T_ + t) * P_, f.q + (t * H_ + h) * (P_ + R_),
                             P_ * sizeof(uint16_t));
    /* same math, other layouts: identical bits */
    ck_assert_mem_eq(o_contig, f.o, sizeof(uint16_t) * T_ * H_ * V_);
    ck_assert_mem_eq(lse_contig, f.lse, sizeof(float) * H_ * T_);
    /* the last token has no valid slot: o = 0, lse = -inf */
    for (int h = 0; h < H_; h++) {
        ck_assert(isinf(f.lse[h * T_ + T_ - 1]) && f.lse[h * T_ + T_ - 1] < 0);
        for (int v = 0; v < V_; v++)
            ck_assert_uint_eq(f.o[(T_ - 1) * H_ * V_ + h * V_ + v], 0);
    }
    printf("SAFE_OP: strided q_nope view passed as is; token-major output equals head-major\n");
    free(o_contig);
    free(lse_contig);
    mlart_layer_destroy(a);
    mlart_layer_destroy(b);
}
END_TEST

START_TEST(dense_weights_keep_their_address)
{
    mlart_layer *ly = make("testhost");
    mlart_tensor uk, uv;
    mlart_step_io io = fx_io(&f);
    ck_assert_int_eq(mlart_layer_weights(ly, &uk, &uv), 0);
    ck_assert_ptr_eq(uk.data, f.w_uk_t);
    ck_assert_ptr_eq(uv.data, f.w_uv);
    decode_ok(ly, &io);
    ck_assert_ptr_eq(record_of("testhost")->step.w_uk_t.data, f.w_uk_t);
    ck_assert_ptr_eq(record_of("testhost")->step.w_uv.data, f.w_uv);
    mlart_layer_destroy(ly);
}
END_TEST

START_TEST(strided_weights_replaced_by_dense_copy)
{
    mlart_layer_desc d = fx_desc(&f, "testhost");
    mlart_tensor kvb = fx_view(f.kv_b_proj, MLART_DTYPE_BF16, 2, H_ * (P_ + V_), L_, 0);
    mlart_layer *dense = make("testhost"), *ly = NULL;
    mlart_tensor uk, uv;
    mlart_step_io io = fx_io(&f);
    uint16_t *o_dense = malloc(sizeof(uint16_t) * T_ * H_ * V_);
    ck_assert_int_eq(mlart_weights_from_kv_b_proj(&f.g, &kvb, &d.w_uk_t, &d.w_uv), 0);
    ck_assert_int_eq(mlart_layer_create(ctx, &d, &ly), 0);
    ck_assert_int_eq(mlart_layer_weights(ly, &uk, &uv), 0);
    ck_assert_ptr_ne(uk.data, d.w_uk_t.data);
    ck_assert_ptr_ne(uv.data, d.w_uv.data);
    ck_assert_int_eq(mlart_tensor_is_dense(&uk), 1);
    ck_assert_int_eq(mlart_tensor_is_dense(&uv), 1);
    ck_assert_int_eq(mlart_tensor_check(&uk, "uk"), 0);
    ck_assert_mem_eq(uk.data, f.w_uk_t, sizeof(uint16_t) * H_ * P_ * L_);
    ck_assert_mem_eq(uv.data, f.w_uv, sizeof(uint16_t) * H_ * L_ * V_); /* the transposed one */
    decode_ok(dense, &io);
    memcpy(o_dense, f.o, sizeof(uint16_t) * T_ * H_ * V_);
    decode_ok(ly, &io);
    ck_assert_ptr_eq(record_of("testhost")->step.w_uv.data, uv.data);
    ck_assert_mem_eq(o_dense, f.o, sizeof(uint16_t) * T_ * H_ * V_);
    printf("strided kv_b_proj views replaced by dense copies; output identical\n");
    free(o_dense);
    mlart_layer_destroy(ly);
    mlart_layer_destroy(dense);
}
END_TEST

/* A contract with tail_pad: inputs must have that many readable bytes past
 * their spans; weights without them are copied into padded buffers. */
START_TEST(tail_pad)
{
    const size_t pad = 256;
    mlart_layer_desc d = fx_desc(&f, "testpad");
    mlart_layer *ly = NULL;
    mlart_tensor uk, uv;
    mlart_step_io io;
    void *bufs[6];
    size_t bytes[6] = {sizeof(uint16_t) * T_ * H_ * (P_ + R_), sizeof(int32_t) * T_ * K_,
                       sizeof(int32_t) * T_, sizeof(int32_t) * B_, sizeof(int32_t) * B_ * MB_,
                       (size_t)f.num_slots * (L_ + R_) * 2};
    void *src[6] = {f.q, f.idx, f.req, f.lens, f.bt, f.cache};
    /* the fixture's cache has no padding: refused */
    ck_assert_int_eq(mlart_layer_create(ctx, &d, &ly), MLART_ELAYOUT);
    ck_assert_ptr_null(ly);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "kv_cache"));
    for (int i = 0; i < 6; i++) {
        bufs[i] = malloc(bytes[i] + pad);
        memcpy(bufs[i], src[i], bytes[i]);
    }
    d.kv_cache.data = bufs[5], d.kv_cache.base = bufs[5], d.kv_cache.extent = bytes[5] + pad;
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
    ck_assert_int_eq(mlart_layer_weights(ly, &uk, &uv), 0);
    ck_assert_ptr_ne(uk.data, f.w_uk_t); /* dense but unpadded: copied */
    ck_assert_uint_eq(uk.extent, sizeof(uint16_t) * H_ * P_ * L_ + pad);
    io = fx_io(&f);
    ck_assert_int_eq(mlart_layer_decode(ly, &io, NULL), MLART_ELAYOUT);
    ck_assert_ptr_nonnull(strstr(mlart_last_error(), "256 readable bytes"));
    io.q.data = bufs[0], io.q.base = bufs[0], io.q.extent = bytes[0] + pad;
    io.idx.data = bufs[1], io.idx.base = bufs[1], io.idx.extent = bytes[1] + pad;
    io.req_of_token.data = bufs[2], io.req_of_token.base = bufs[2];
    io.req_of_token.extent = bytes[2] + pad;
    io.seq_lens.data = bufs[3], io.seq_lens.base = bufs[3], io.seq_lens.extent = bytes[3] + pad;
    io.block_table.data = bufs[4], io.block_table.base = bufs[4];
    io.block_table.extent = bytes[4] + pad;
    decode_ok(ly, &io);
    mlart_layer_destroy(ly);
    for (int i = 0; i < 6; i++)
        free(bufs[i]);
}
END_TEST

START_TEST(strided_lse)
{
    mlart_layer *ly = make("testhost");
    mlart_step_io io = fx_io(&f);
    float *wide = malloc(sizeof(float) * H_ * (T_ + 3)), *dense = malloc(sizeof(float) * H_ * T_);
    decode_ok(ly, &io);
    memcpy(dense, f.lse, sizeof(float) * H_ * T_);
    for (int i = 0; i < H_ * (T_ + 3); i++)
        wide[i] = 12345.0f;
    io.lse.data = wide, io.lse.base = wide, io.lse.extent = sizeof(float) * H_ * (T_ + 3);
    io.lse.stride[0] = T_ + 3;
    ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "%s", mlart_last_error());
    for (int h = 0; h < H_; h++) {
        ck_assert_mem_eq(wide + h * (T_ + 3), dense + h * T_, sizeof(float) * T_);
        ck_assert(wide[h * (T_ + 3) + T_] == 12345.0f); /* gaps untouched */
    }
    /* no lse wanted */
    memset(&io.lse, 0, sizeof io.lse);
    ck_assert_int_eq(mlart_layer_decode(ly, &io, NULL), 0);
    free(wide);
    free(dense);
    mlart_layer_destroy(ly);
}
END_TEST

/* Expect decode to fail with rc, name `needle`, and leave o and lse
 * untouched. */
static void bad_step(mlart_layer *ly, const mlart_step_io *io, int rc, const char *needle)
{
    uint16_t before[T_ * H_ * V_];
    float lse_before[H_ * T_];
    int got;
    poison();
    memcpy(before, f.o, sizeof before);
    memcpy(lse_before, f.lse, sizeof lse_before);
    got = mlart_layer_decode(ly, io, NULL);
    printf("  %-16s %s\n", mlart_status_name(got), mlart_last_error());
    ck_assert_int_eq(got, rc);
    ck_assert_msg(strstr(mlart_last_error(), needle), "want '%s' in '%s'", needle,
                  mlart_last_error());
    ck_assert_mem_eq(before, f.o, sizeof before);
    ck_assert_mem_eq(lse_before, f.lse, sizeof lse_before);
}

START_TEST(bad_steps_refused)
{
    mlart_layer *ly = make("testhost");
    mlart_step_io good = fx_io(&f), io;
    int32_t save;
    int attends = record_of("testhost")->attends;
    io = good, io.q.shape[1] = H_ - 1;
    bad_step(ly, &io, MLART_ESHAPE, "q: shape");
    io = good, io.q.dtype = MLART_DTYPE_F32;
    bad_step(ly, &io, MLART_EDTYPE, "q: dtype f32");
    io = good, io.q.stride[2] = 2;
    bad_step(ly, &io, MLART_ELAYOUT, "q: inner stride");
    io = good, io.q.extent -= 2;
    bad_step(ly, &io, MLART_ELAYOUT, "q: span");
    io = good, io.q.device = 0;
    bad_step(ly, &io, MLART_EINVAL, "q: lives on device 0");
    io = good, io.idx.stride[0] = K_ + 1, io.idx.shape[1] = K_;
    bad_step(ly, &io, MLART_ELAYOUT, "idx: must be dense");
    io = good, io.o.shape[1] = H_ * V_ + 1;
    bad_step(ly, &io, MLART_ESHAPE, "o: shape");
    io = good, io.lse.dtype = MLART_DTYPE_BF16;
    bad_step(ly, &io, MLART_EDTYPE, "lse: dtype");
    /* outputs whose rows share elements, or that share bytes: refused before
     * attend() writes the caller's lse (the V up-projection alone used to
     * catch o, after that) */
    io = good, io.o.stride[0] = H_ * V_ - 1;
    bad_step(ly, &io, MLART_ELAYOUT, "o: rows overlap");
    io = good, io.lse.stride[0] = 1;
    bad_step(ly, &io, MLART_ELAYOUT, "lse: rows overlap");
    io = good, io.lse.data = (float *)(void *)f.o + 8, io.lse.base = f.o;
    io.lse.extent = sizeof(uint16_t) * T_ * H_ * V_;
    bad_step(ly, &io, MLART_ELAYOUT, "o and lse: the outputs overlap");
    io = good, io.T = T_ + 1;
    bad_step(ly, &io, MLART_ERANGE, "max_tokens");
    io = good, io.B = B_ + 1;
    bad_step(ly, &io, MLART_ERANGE, "max_requests");
    io = good, io.block_table.shape[1] = MB_ - 1;
    bad_step(ly, &io, MLART_ESHAPE, "block_table: shape");
    /* values */
    save = f.idx[2 * K_ + 3];
    f.idx[2 * K_ + 3] = f.lens[f.req[2]]; /* == seq_len */
    bad_step(ly, &good, MLART_ERANGE, "idx[2][3]");
    f.idx[2 * K_ + 3] = -2;
    bad_step(ly, &good, MLART_ERANGE, "idx[2][3] = -2");
    f.idx[2 * K_ + 3] = save;
    save = f.req[1];
    f.req[1] = B_;
    bad_step(ly, &good, MLART_ERANGE, "req_of_token[1]");
    f.req[1] = save;
    save = f.lens[0];
    f.lens[0] = MB_ * PAGE_ + 1;
    bad_step(ly, &good, MLART_ERANGE, "seq_lens[0]");
    f.lens[0] = save;
    save = f.bt[0];
    f.bt[0] = (int32_t)(f.num_slots / PAGE_); /* a block past the cache */
    {
        int used = 0; /* only an error if some index goes through block 0 of request 0 */
        for (int t = 0; t < T_; t++)
            for (int k = 0; k < K_; k++)
                used |= f.req[t] == 0 && f.idx[t * K_ + k] >= 0 && f.idx[t * K_ + k] < PAGE_;
        if (used)
            bad_step(ly, &good, MLART_ERANGE, "block_table[0][0]");
    }
    f.bt[0] = save;
    ck_assert_int_eq(record_of("testhost")->attends, attends); /* the backend never ran */
    decode_ok(ly, &good);
    mlart_layer_destroy(ly);
}
END_TEST

/* Outputs over inputs of the step, on the test backend (loop index 0) and
 * the reference (1): refused before anything runs, naming both, with o, lse
 * and every byte the step reads as they were.  The layer refuses them
 * itself: attend writes lse before the V up-projection's op checks o, and a
 * backend need not check its outputs against its inputs. */
static const char *const overlap_backends[] = {"testhost", NULL};

/* The fixture's buffers a step reads or writes, concatenated into dst (when
 * not NULL); returns their size. */
static size_t snapshot(unsigned char *dst)
{
    const void *src[] = {f.q, f.idx, f.req, f.lens, f.bt, f.w_uk_t, f.w_uv, f.cache, f.o, f.lse};
    const size_t bytes[] = {sizeof(uint16_t) * T_ * H_ * (P_ + R_), sizeof(int32_t) * T_ * K_,
                            sizeof(int32_t) * T_, sizeof(int32_t) * B_,
                            sizeof(int32_t) * B_ * MB_, sizeof(uint16_t) * H_ * P_ * L_,
                            sizeof(uint16_t) * H_ * L_ * V_, (size_t)f.num_slots * (L_ + R_) * 2,
                            sizeof(uint16_t) * T_ * H_ * V_, sizeof(float) * H_ * T_};
    size_t n = 0;
    for (size_t i = 0; i < sizeof src / sizeof src[0]; i++) {
        if (dst)
            memcpy(dst + n, src[i], bytes[i]);
        n += bytes[i];
    }
    return n;
}

static void overlap_refused(int backend, const mlart_step_io *io, const char *needle)
{
    mlart_layer *ly = make(overlap_backends[backend]);
    size_t n = snapshot(NULL);
    unsigned char *before = malloc(n), *after = malloc(n);
    int attends = backend == 0 ? record_of("testhost")->attends : 0;
    printf("%s:\n", mlart_layer_backend_name(ly));
    poison(); /* as bad_step does first */
    snapshot(before);
    bad_step(ly, io, MLART_ELAYOUT, needle);
    snapshot(after);
    ck_assert_msg(memcmp(before, after, n) == 0, "the refused step changed the fixture's bytes");
    if (backend == 0)
        ck_assert_int_eq(record_of("testhost")->attends, attends);
    free(before);
    free(after);
    mlart_layer_destroy(ly);
}

/* attend would overwrite the indices it was validated for, then follow them */
START_TEST(lse_over_idx_refused)
{
    mlart_step_io io = fx_io(&f);
    io.lse = fx_view(f.idx, MLART_DTYPE_F32, 2, H_, T_, 0);
    overlap_refused(_i, &io, "lse and idx");
}
END_TEST

START_TEST(o_over_kv_cache_refused)
{
    mlart_step_io io = fx_io(&f);
    io.o = fx_view(f.cache, MLART_DTYPE_BF16, 2, T_, H_ * V_, 0);
    overlap_refused(_i, &io, "o and kv_cache");
}
END_TEST

START_TEST(o_over_w_uv_refused)
{
    mlart_step_io io = fx_io(&f);
    io.o = fx_view(f.w_uv, MLART_DTYPE_BF16, 2, T_, H_ * V_, 0);
    overlap_refused(_i, &io, "o and w_uv");
}
END_TEST

/* seq_lens inside a buffer that lse covers too */
START_TEST(lse_over_seq_lens_refused)
{
    mlart_step_io io = fx_io(&f);
    float *buf = calloc(H_ * T_, sizeof(float)), *before = malloc(sizeof(float) * H_ * T_);
    memcpy(buf + 4, f.lens, sizeof(int32_t) * B_);
    io.seq_lens = fx_view(buf + 4, MLART_DTYPE_I32, 1, B_, 0, 0);
    io.lse = fx_view(buf, MLART_DTYPE_F32, 2, H_, T_, 0);
    memcpy(before, buf, sizeof(float) * H_ * T_);
    overlap_refused(_i, &io, "lse and seq_lens");
    ck_assert_mem_eq(before, buf, sizeof(float) * H_ * T_);
    free(buf);
    free(before);
}
END_TEST

/* the rest of what a step reads: q and W_UK_T */
START_TEST(outputs_over_q_and_w_uk_t_refused)
{
    mlart_step_io io = fx_io(&f);
    io.o = fx_view(f.q, MLART_DTYPE_BF16, 2, T_, H_ * V_, 0);
    overlap_refused(_i, &io, "o and q");
    io = fx_io(&f);
    io.lse = fx_view(f.w_uk_t, MLART_DTYPE_F32, 2, H_, T_, 0);
    overlap_refused(_i, &io, "lse and w_uk_t");
}
END_TEST

/* o and q rows interleaved in one buffer ([o row | q row] a token) share no
 * byte: accepted, and o the same bits as from separate buffers. */
START_TEST(o_and_q_rows_interleaved)
{
    enum { OW = H_ * V_, QW = H_ * (P_ + R_), W = OW + QW };
    mlart_layer *ly = make(overlap_backends[_i]);
    mlart_step_io io = fx_io(&f);
    uint16_t *buf = malloc(sizeof(uint16_t) * T_ * W), *want = malloc(sizeof(uint16_t) * T_ * OW);
    decode_ok(ly, &io);
    memcpy(want, f.o, sizeof(uint16_t) * T_ * OW);
    for (int t = 0; t < T_; t++) {
        memset(buf + t * W, 0xff, sizeof(uint16_t) * OW); /* NaN poison */
        memcpy(buf + t * W + OW, f.q + t * QW, sizeof(uint16_t) * QW);
    }
    io.o = fx_view(buf, MLART_DTYPE_BF16, 2, T_, OW, 0);
    io.o.stride[0] = W, io.o.extent = sizeof(uint16_t) * T_ * W;
    io.q = fx_view(buf + OW, MLART_DTYPE_BF16, 3, T_, H_, P_ + R_);
    io.q.base = buf, io.q.stride[0] = W, io.q.extent = sizeof(uint16_t) * T_ * W;
    ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "interleaved: %s", mlart_last_error());
    for (int t = 0; t < T_; t++) {
        ck_assert_mem_eq(buf + t * W, want + t * OW, sizeof(uint16_t) * OW);
        ck_assert_mem_eq(buf + t * W + OW, f.q + t * QW, sizeof(uint16_t) * QW);
    }
    /* o one element later: each o row meets the next q row, refused */
    io.o.data = buf + 1;
    bad_step(ly, &io, MLART_ELAYOUT, "o and q");
    free(buf);
    free(want);
    mlart_layer_destroy(ly);
}
END_TEST

/* One head: o's rows around W_UV in one buffer (o row 0, then W_UV [1,L,V],
 * then o row 1, ...).  They share no byte: the layer and the V
 * up-projection's own check both take the step, and o gets the bits of a
 * step with separate buffers, W_UV untouched. */
static const char *const one_head_backends[] = {"testsafe", NULL};

START_TEST(one_head_o_around_w_uv)
{
    enum { S = V_ + L_ * V_ };
    fx g;
    mlart_layer_desc d;
    mlart_layer *plain = NULL, *ly = NULL;
    mlart_step_io io;
    const int64_t wsh[3] = {1, L_, V_};
    const size_t n = (size_t)(T_ - 1) * S + V_ + 1; /* one spare element for the shifted o */
    uint16_t *buf = calloc(n, sizeof(uint16_t)), *want = malloc(sizeof(uint16_t) * T_ * V_);
    fx_init(&g, 1, P_, R_, L_, V_, K_, PAGE_, T_, B_, MB_, f.seed);
    d = fx_desc(&g, one_head_backends[_i]);
    ck_assert_msg(mlart_layer_create(ctx, &d, &plain) == 0, "%s", mlart_last_error());
    io = fx_io(&g);
    ck_assert_msg(mlart_layer_decode(plain, &io, NULL) == 0, "%s", mlart_last_error());
    memcpy(want, g.o, sizeof(uint16_t) * T_ * V_);
    memcpy(buf + V_, g.w_uv, sizeof(uint16_t) * L_ * V_);
    d.w_uv = mlart_tensor_dense(buf + V_, MLART_DTYPE_BF16, -1, 3, wsh);
    d.w_uv.base = buf, d.w_uv.extent = n * sizeof(uint16_t);
    ck_assert_msg(mlart_layer_create(ctx, &d, &ly) == 0, "%s", mlart_last_error());
    io.o.data = buf, io.o.base = buf, io.o.extent = n * sizeof(uint16_t), io.o.stride[0] = S;
    for (int t = 0; t < T_; t++)
        memset(buf + (size_t)t * S, 0xff, sizeof(uint16_t) * V_); /* NaN poison */
    ck_assert_msg(mlart_layer_decode(ly, &io, NULL) == 0, "o around w_uv: %s", mlart_last_error());
    for (int t = 0; t < T_; t++)
        ck_assert_mem_eq(buf + (size_t)t * S, want + (size_t)t * V_, sizeof(uint16_t) * V_);
    ck_assert_mem_eq(buf + V_, g.w_uv, sizeof(uint16_t) * L_ * V_);
    /* o one element later: its row 0 meets W_UV, refused before attend runs */
    io.o.data = buf + 1;
    ck_assert_int_eq(mlart_layer_decode(ly, &io, NULL), MLART_ELAYOUT);
    ck_assert_msg(strstr(mlart_last_error(), "o and w_uv"), "%s", mlart_last_error());
    mlart_layer_destroy(plain);
    mlart_layer_destroy(ly);
    fx_free(&g);
    free(buf);
    free(want);
}
END_TEST

static void bad_create(mlart_layer_desc *d, int rc, const char *needle)
{
    mlart_layer *keep = (mlart_layer *)0x1, *ly = keep;
    int got = mlart_layer_create(ctx, d, &ly);
    printf("  %-16s %s\n", mlart_status_name(got), mlart_last_error());
    ck_assert_int_eq(got, rc);
    ck_assert_ptr_eq(ly, keep);
    ck_assert_msg(strstr(mlart_last_error(), needle), "want '%s' in '%s'", needle,
                  mlart_last_error());
}

START_TEST(bad_layers_refused)
{
    mlart_layer_desc good = fx_desc(&f, "testhost"), d;
    d = good, d.backend = "nosuchbackend";
    bad_create(&d, MLART_ENOBACKEND, "unknown backend 'nosuchbackend'");
    d = good, d.backend = "badabi";
    bad_create(&d, MLART_EABI, "ABI version 2");
    /* a backend failing without a detail: named, not the thread's last message */
    mlart_set_error(MLART_EINVAL, "a message of an earlier call");
    d = good, d.backend = "silentplan";
    bad_create(&d, MLART_ENOTSUP, "backend 'silentplan': plan returned MLART_ENOTSUP without a detail");
    d = good, d.geom.heads = 10; /* contract: at most 8 */
    d.w_uk_t.shape[0] = 10, d.w_uv.shape[0] = 10;
    bad_create(&d, MLART_ENOTSUP, "at most 8 heads");
    d = good, d.geom.heads = 3; /* contract: multiple of 2 */
    bad_create(&d, MLART_ENOTSUP, "multiple of 2");
    d = good, d.geom.topk = 128;
    bad_create(&d, MLART_ENOTSUP, "topk <= 64");
    d = good, d.geom.kv_format = MLART_KV_FP8_DS_MLA, d.geom.kv_lora = 128;
    bad_create(&d, MLART_ENOTSUP, "kv_format fp8_ds_mla");
    d = good, d.w_uk_t.shape[1] = P_ + 1;
    bad_create(&d, MLART_ESHAPE, "w_uk_t: shape");
    d = good, d.w_uv.dtype = MLART_DTYPE_F32;
    bad_create(&d, MLART_EDTYPE, "w_uv: dtype");
    d = good, d.w_uv.extent -= 2;
    bad_create(&d, MLART_ELAYOUT, "w_uv: span");
    d = good, d.w_uk_t.device = 0;
    bad_create(&d, MLART_EINVAL, "w_uk_t: lives on device 0");
    d = good, d.kv_cache.shape[1] = 656;
    bad_create(&d, MLART_ESHAPE, "kv_cache: shape");
    {
        /* the cache and a weight in one buffer, 16 bytes shared: a cache
         * write would change the weight */
        const size_t cb = (size_t)f.num_slots * mlart_kv_bytes_per_token(&f.g),
                     wb = (size_t)H_ * P_ * L_ * 2, vb = (size_t)H_ * L_ * V_ * 2;
        unsigned char *buf = malloc(cb + wb + vb);
        ck_assert_ptr_nonnull(buf);
        d = good;
        d.kv_cache = fx_view(buf, MLART_DTYPE_U8, 2, f.num_slots,
                             (int64_t)mlart_kv_bytes_per_token(&f.g), 0);
        d.w_uk_t = fx_view(buf + cb - 16, MLART_DTYPE_BF16, 3, H_, P_, L_);
        bad_create(&d, MLART_ELAYOUT, "kv_cache and w_uk_t: the cache overlaps a weight");
        d.w_uk_t = good.w_uk_t;
        d.w_uv = fx_view(buf + 16, MLART_DTYPE_BF16, 3, H_, L_, V_);
        bad_create(&d, MLART_ELAYOUT, "kv_cache and w_uv: the cache overlaps a weight");
        free(buf);
    }
    d = good, d.max_tokens = 0;
    bad_create(&d, MLART_EINVAL, "max_tokens 0");
    d = good, d.geom.page_size = 0;
    bad_create(&d, MLART_EINVAL, "page_size");
    /* sizes past 2^63 bytes: refused before any product wraps (a broadcast
     * weight view of these dims would pass every span check) */
    d = good, d.geom.qk_nope = 1 << 30, d.geom.kv_lora = 1 << 30;
    bad_create(&d, MLART_ERANGE, "larger than 2^63 bytes");
    ck_assert_int_eq(record_of("testhost")->creates, record_of("testhost")->destroys);
    mlart_layer_destroy(NULL);
}
END_TEST

START_TEST(write_kv)
{
    mlart_layer *ly = make("testhost");
    uint16_t rows[3 * (L_ + R_)];
    int32_t slots[3] = {5, 0, (int32_t)f.num_slots - 1};
    mlart_tensor lat = fx_view(rows, MLART_DTYPE_BF16, 2, 3, L_ + R_, 0);
    mlart_tensor sl = fx_view(slots, MLART_DTYPE_I32, 1, 3, 0, 0);
    fx_rng r = {f.seed + 1};
    for (int i = 0; i < 3 * (L_ + R_); i++)
        rows[i] = mlart_f32_to_bf16(fx_uniform(&r));
    ck_assert_msg(mlart_layer_write_kv(ly, &lat, &sl, NULL) == 0, "%s", mlart_last_error());
    for (int i = 0; i < 3; i++)
        ck_assert_mem_eq(f.cache + (size_t)slots[i] * (L_ + R_) * 2, rows + i * (L_ + R_),
                         (L_ + R_) * 2);
    lat.device = 0;
    ck_assert_int_eq(mlart_layer_write_kv(ly, &lat, &sl, NULL), MLART_EINVAL);
    lat.device = -1;
    lat.shape[1] = L_;
    ck_assert_int_lt(mlart_layer_write_kv(ly, &lat, &sl, NULL), 0);
    mlart_layer_destroy(ly);
}
END_TEST

#ifdef MLART_HAVE_REFERENCE
/* The default host backend is the reference; it agrees with the test backend. */
START_TEST(reference_by_default)
{
    mlart_layer *ref = make(NULL), *th = make("testhost");
    mlart_step_io io = fx_io(&f);
    uint16_t o_th[T_ * H_ * V_];
    double num = 0.0, den = 0.0;
    ck_assert_str_eq(mlart_layer_backend_name(ref), "reference");
    decode_ok(th, &io);
    memcpy(o_th, f.o, sizeof o_th);
    decode_ok(ref, &io);
    for (int i = 0; i < T_ * H_ * V_; i++) {
        double a = mlart_bf16_to_f32(f.o[i]), b = mlart_bf16_to_f32(o_th[i]);
        num += (a - b) * (a - b);
        den += b * b;
    }
    printf("reference vs test backend: nmse %.3e\n", num / den);
    ck_assert(num / den < 1e-4);
    mlart_layer_destroy(ref);
    mlart_layer_destroy(th);
}
END_TEST
#endif

int main(void)
{
    Suite *s = suite_create("runtime_layer");
    TCase *tc = tcase_create("layer");
#ifdef MLART_HAVE_REFERENCE
    const int overlap_runs = 2; /* the test backend, then the reference */
#else
    const int overlap_runs = 1;
#endif
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, contract_reaches_layer);
    tcase_add_test(tc, contiguous_query_is_exact_split_transpose);
    tcase_add_test(tc, safe_op_gets_strided_view);
    tcase_add_test(tc, dense_weights_keep_their_address);
    tcase_add_test(tc, strided_weights_replaced_by_dense_copy);
    tcase_add_test(tc, tail_pad);
    tcase_add_test(tc, strided_lse);
    tcase_add_test(tc, bad_steps_refused);
    tcase_add_loop_test(tc, lse_over_idx_refused, 0, overlap_runs);
    tcase_add_loop_test(tc, o_over_kv_cache_refused, 0, overlap_runs);
    tcase_add_loop_test(tc, o_over_w_uv_refused, 0, overlap_runs);
    tcase_add_loop_test(tc, lse_over_seq_lens_refused, 0, overlap_runs);
    tcase_add_loop_test(tc, outputs_over_q_and_w_uk_t_refused, 0, overlap_runs);
    tcase_add_loop_test(tc, o_and_q_rows_interleaved, 0, overlap_runs);
    tcase_add_loop_test(tc, one_head_o_around_w_uv, 0, overlap_runs);
    tcase_add_test(tc, bad_layers_refused);
    tcase_add_test(tc, write_kv);
#ifdef MLART_HAVE_REFERENCE
    tcase_add_test(tc, reference_by_default);
#endif
    suite_add_tcase(s, tc);
    return check_run(s, CK_FORK_GETENV);
}
