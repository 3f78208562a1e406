/*
 * rope.c - a file's RoPE: base, rotated dims, pairing and frequency
 * scaling, as one pos_scheme the attention kernel applies.
 *
 * Every scaling a GGUF file can ask for reduces to two things the kernel
 * already takes: a global position scale (rope_freq_scale) and one divisor
 * per rotation pair (rope_freq_factors), because each of them only changes
 * each pair's angular frequency, never the linearity of angle in position:
 *
 *   linear   rope.scaling.type = "linear" (or the older rope.scale_linear):
 *            every frequency times 1/factor.
 *   rope_freqs.weight  a tensor of rope_dims/2 factors (Llama 3.1 and later:
 *            the converter bakes the "llama3" scaling of the checkpoint into
 *            it): pair i's frequency divided by factor i.
 *   yarn     rope.scaling.type = "yarn": pair i's angle is
 *            pos * inv_freq_i * (s (1 - r_i) + r_i), s = 1/factor, where the
 *            ramp r_i (times yarn_ext_factor) goes from 1 for the pairs
 *            that turn more than beta_fast times over the original
 *            context (kept as trained) to 0 for those that turn fewer than
 *            beta_slow times (interpolated), as ggml's rope_yarn computes
 *            it. With global scale s that is a divisor of
 *            s / (s (1 - r_i) + r_i). YaRN also scales the rotated q and k
 *            by mscale = attn_factor * (1 + 0.1 ln(factor)); the product of
 *            both is mscale^2 times the attention logit, which the model
 *            folds into the attention scale (so a file whose rotation
 *            covers only part of the head is refused).
 *
 * Refused with the key named: other scaling types ("longrope" belongs to
 * the Phi-3 loader), non-positive or non-finite values, a rope_freqs of the
 * wrong length or with a non-positive factor.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* ggml's YaRN correction dimension: the pair index whose frequency turns
 * n_rot times over n_ctx_orig positions. */
static double yarn_corr_dim(int n_dims, int n_ctx_orig, double n_rot, double base)
{
    return n_dims * log(n_ctx_orig / (n_rot * 2 * M_PI)) / (2 * log(base));
}

/* YaRN's divisors into f (which may hold rope_freqs already) and the logit
 * multiplier. */
static int yarn_factors(model *m, float *f, float factor, char *err, size_t errlen)
{
    const char *a = m->arch_name;
    int orig, rc;
    float ext, attn_factor, beta_fast, beta_slow, attn_old;
    bool found;
    rc = model_meta_int(m->file, a, "rope.scaling.original_context_length", true, 0, 1, INT32_MAX,
                        &orig, err, errlen);
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.yarn_ext_factor", 1.0f, &ext, NULL, err,
                               errlen);
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.attn_factor", 1.0f, &attn_old, NULL, err,
                               errlen);
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.yarn_attn_factor", attn_old, &attn_factor,
                               NULL, err, errlen);
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.yarn_beta_fast", 32.0f, &beta_fast, NULL,
                               err, errlen);
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.yarn_beta_slow", 1.0f, &beta_slow, NULL,
                               err, errlen);
    float log_mul;
    rc = rc ? rc
            : model_meta_float(m->file, a, "rope.scaling.yarn_log_multiplier", 0.0f, &log_mul,
                               &found, err, errlen);
    if (rc)
        return rc;
    if (found && log_mul != 0.0f) {
        snprintf(err, errlen,
                 "%s.rope.scaling.yarn_log_multiplier (DeepSeek's YaRN) is not supported", a);
        return -EINVAL;
    }
    if (!(ext >= 0.0f && ext <= 1.0f) || !(attn_factor > 0.0f) || !(beta_fast > 0.0f) ||
        !(beta_slow > 0.0f)) {
        snprintf(err, errlen,
                 "%s.rope.scaling: yarn_ext_factor %g must be in [0, 1], attn_factor %g, "
                 "yarn_beta_fast %g and yarn_beta_slow %g positive",
                 a, ext, attn_factor, beta_fast, beta_slow);
        return -EINVAL;
    }
    int n_rot = m->pos.rope_dims;
    double base = m->pos.rope_theta, s = 1.0 / factor;
    double lo = floor(yarn_corr_dim(n_rot, orig, beta_fast, base));
    double hi = ceil(yarn_corr_dim(n_rot, orig, beta_slow, base));
    lo = lo > 0 ? lo : 0;
    hi = hi < n_rot - 1 ? hi : n_rot - 1;
    for (int i = 0; i < n_rot / 2; i++) {
        double y = (i - lo) / (hi - lo > 0.001 ? hi - lo : 0.001);
        double ramp = (1.0 - (y < 0 ? 0 : y > 1 ? 1 : y)) * ext;
        f[i] = (float)((double)f[i] * s / (s * (1.0 - ramp) + ramp));
    }
    double mscale = ext != 0.0f ? attn_factor * (1.0 + 0.1 * log(factor)) : attn_factor;
    if (mscale != 1.0 && n_rot != m->head_dim) {
        snprintf(err, errlen,
                 "%s.rope.scaling.type = yarn with attention scaling on %d of %d dims per head "
                 "is not supported",
                 a, n_rot, m->head_dim);
        return -EINVAL;
    }
    m->attn_logit_mul = (float)(mscale * mscale);
    return 0;
}

/* The scaling type and factor (linear, yarn, none). *yarn tells which. */
static int scaling(model *m, float *factor, bool *yarn, char *err, size_t errlen)
{
    const char *a = m->arch_name;
    char key[128];
    snprintf(key, sizeof(key), "%s.rope.scaling.type", a);
    const char *st;
    size_t stn;
    *yarn = false;
    if (!gguf_get_str(m->file, key, &st, &stn) && !(stn == 4 && !memcmp(st, "none", 4))) {
        *yarn = stn == 4 && !memcmp(st, "yarn", 4);
        if (!*yarn && !(stn == 6 && !memcmp(st, "linear", 6))) {
            snprintf(err, errlen, "%s = '%.*s' is not supported (kvd runs none, linear and yarn)",
                     key, (int)(stn > 32 ? 32 : stn), st);
            return -EINVAL;
        }
        int rc =
            model_meta_float(m->file, a, "rope.scaling.factor", 1.0f, factor, NULL, err, errlen);
        if (rc)
            return rc;
        if (!(*factor > 0.0f)) {
            snprintf(err, errlen, "%s.rope.scaling.factor %g must be positive", a, *factor);
            return -EINVAL;
        }
        return 0;
    }
    /* newer files name it rope.scaling.*, older ones rope.scale_linear */
    int rc = model_meta_float(m->file, a, "rope.scale_linear", 1.0f, factor, NULL, err, errlen);
    if (rc)
        return rc;
    if (!(*factor > 0.0f)) {
        snprintf(err, errlen, "%s.rope.scale_linear %g must be positive", a, *factor);
        return -EINVAL;
    }
    return 0;
}

/* rope_freqs.weight into m->rope_factors, or all ones. *found says which. */
static int freq_factors(model *m, bool *found, char *err, size_t errlen)
{
    int half = m->pos.rope_dims / 2;
    m->rope_factors = malloc(sizeof(float) * (size_t)half);
    if (!m->rope_factors) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    const float *got;
    int rc = model_load_vector(m->file, "rope_freqs.weight", half, false, m->rope_factors, &got,
                               err, errlen);
    if (rc)
        return rc;
    *found = got != NULL;
    for (int i = 0; i < half; i++) {
        if (!*found)
            m->rope_factors[i] = 1.0f;
        else if (!(m->rope_factors[i] > 0.0f)) {
            snprintf(err, errlen, "tensor rope_freqs.weight: factor %d (%g) must be positive", i,
                     m->rope_factors[i]);
            return -EINVAL;
        }
    }
    return 0;
}

int model_read_rope(model *m, enum pos_rope_pairing pairing, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    const char *a = m->arch_name;
    int n_rot;
    int rc = model_meta_int(f, a, "rope.dimension_count", false, m->head_dim, 2, m->head_dim,
                            &n_rot, err, errlen);
    if (rc)
        return rc;
    if (n_rot % 2) {
        snprintf(err, errlen, "%s.rope.dimension_count %d is odd", a, n_rot);
        return -EINVAL;
    }
    float theta;
    rc = model_meta_float(f, a, "rope.freq_base", 10000.0f, &theta, NULL, err, errlen);
    if (rc)
        return rc;
    if (!(theta > 0.0f)) {
        snprintf(err, errlen, "%s.rope.freq_base (%g) must be positive", a, theta);
        return -EINVAL;
    }
    m->pos = (struct pos_scheme){
        .kind = POS_ROPE,
        .rope_theta = theta,
        .rope_dims = n_rot,
        .rope_pairing = pairing,
        .rope_freq_scale = 1.0f,
    };
    m->attn_logit_mul = 1.0f;

    float factor;
    bool yarn, have_freqs;
    if ((rc = scaling(m, &factor, &yarn, err, errlen)) ||
        (rc = freq_factors(m, &have_freqs, err, errlen)))
        return rc;
    m->pos.rope_freq_scale = 1.0f / factor;
    if (yarn && (rc = yarn_factors(m, m->rope_factors, factor, err, errlen)))
        return rc;
    if (have_freqs || yarn)
        m->pos.rope_freq_factors = m->rope_factors;
    return 0;
}
