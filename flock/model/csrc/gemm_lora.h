// LoRA updates on a projection's output (flock/lora/layers.py), over the GEMM of the file that includes this:
// y[m][n] += (mask(x A^T)) B^T, with A's rows the stacked ranks of the step's adapters (packed like any weight),
// the mask zeroing each row's rank columns owned by another adapter (owners[c] != row_ids[r]; no mask without
// row_ids), B the stacked [n][ranks] expansion. x A^T is rounded to bf16 (the expansion's input); the expansion's
// fp32 sums are added to y and rounded once, in its tiles (OUT_ADD).

int flock_lora(const bf16 *x, int64_t ldx, const int32_t *shrink, int64_t ranks, const int32_t *expand, bf16 *y,
               int64_t ldy, int64_t m, int64_t n, int64_t k, const int64_t *row_ids, const int32_t *owners,
               bf16 *shrunk, int32_t threads) {
    int code = flock_gemm(x, ldx, shrink, shrunk, ranks, m, ranks, k, OUT_BF16, threads);
    if (code) return code;
    if (row_ids)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < ranks; c++)
                if (owners[c] != row_ids[r]) shrunk[r * ranks + c] = 0;
    return flock_gemm(shrunk, ranks, expand, y, ldy, m, n, ranks, OUT_ADD, threads);
}

// flock_lora as a step-program op (flock/model/program.py): its arguments as int64 words.
int32_t flock_lora_op(const int64_t *a) {
    return flock_lora((const bf16 *)(intptr_t)a[0], a[1], (const int32_t *)(intptr_t)a[2], a[3],
                      (const int32_t *)(intptr_t)a[4], (bf16 *)(intptr_t)a[5], a[6], a[7], a[8], a[9],
                      (const int64_t *)(intptr_t)a[10], (const int32_t *)(intptr_t)a[11], (bf16 *)(intptr_t)a[12],
                      (int32_t)a[13]);
}
