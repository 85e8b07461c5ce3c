/* The mfh64 lane sums in C, and the same sums taken while copying (moe_ft/store/entry_hash.py defines the
 * function; its NumPy reference is what this must equal bit for bit, tests/test_entry_hash_native.py).
 *
 * Why a copy that hashes: on a CPU node the snapshot's one copy (live tensor -> the store's region) reads
 * every payload word anyway; folding each word into the two lane sums as it passes through the registers
 * makes the checksum free of a second pass over the bytes, and the digest covers exactly what was read
 * from the live tensor. Both functions release the GIL while they run (the training thread keeps it).
 *
 * Built by setup.py as an optional extension: without a C compiler moe-ft runs on the NumPy reference. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mfh64 reads little-endian words with native loads: a big-endian host runs on the NumPy reference"
#endif

#define K0 0x9E3779B1u
#define S0 0x7F4A7C15u
#define K1 0x85EBCA77u
#define S1 0x165667B1u
#define M0 0x85EBCA6Bu
#define M1 0xC2B2AE35u

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one build for every x86-64 host: the loader picks the AVX2 body where the CPU has it */
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline uint32_t fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= M0;
    x ^= x >> 13;
    x *= M1;
    return x ^ (x >> 16);
}

/* Lane sums of nwords little-endian words at src whose first word has index first (mod 2^32). */
MULTIVERSION static void sum_words(const uint8_t *src, size_t nwords, uint32_t first, uint32_t out[2]) {
    uint32_t a = 0, b = 0;
    const uint32_t base0 = first * K0 + S0, base1 = first * K1 + S1;
    for (size_t i = 0; i < nwords; i++) {
        uint32_t w;
        memcpy(&w, src + 4 * i, 4);
        const uint32_t j = (uint32_t)i;
        a += fmix32(w ^ (base0 + j * K0));
        b += fmix32(w ^ (base1 + j * K1));
    }
    out[0] = a;
    out[1] = b;
}

/* The same, storing each word at dst as it is read. */
MULTIVERSION static void copy_sum_words(const uint8_t *src, uint8_t *dst, size_t nwords, uint32_t first,
                                        uint32_t out[2]) {
    uint32_t a = 0, b = 0;
    const uint32_t base0 = first * K0 + S0, base1 = first * K1 + S1;
    for (size_t i = 0; i < nwords; i++) {
        uint32_t w;
        memcpy(&w, src + 4 * i, 4);
        memcpy(dst + 4 * i, &w, 4);
        const uint32_t j = (uint32_t)i;
        a += fmix32(w ^ (base0 + j * K0));
        b += fmix32(w ^ (base1 + j * K1));
    }
    out[0] = a;
    out[1] = b;
}

/* Whole words, then the last 1-3 bytes as one zero-padded word (the definition's tail). */
static void lane_sums(const uint8_t *src, uint8_t *dst, size_t n, uint64_t first, uint32_t out[2]) {
    const size_t whole = n / 4;
    const uint32_t first32 = (uint32_t)first;
    if (dst)
        copy_sum_words(src, dst, whole, first32, out);
    else
        sum_words(src, whole, first32, out);
    const size_t rest = n - 4 * whole;
    if (rest) {
        uint8_t word[4] = {0, 0, 0, 0};
        uint32_t tail[2];
        memcpy(word, src + 4 * whole, rest);
        if (dst)
            memcpy(dst + 4 * whole, word, rest);
        sum_words(word, 1, first32 + (uint32_t)whole, tail);
        out[0] += tail[0];
        out[1] += tail[1];
    }
}

static PyObject *py_lane_sums(PyObject *self, PyObject *args) {
    Py_buffer src;
    unsigned long long first;
    uint32_t out[2];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*K", &src, &first))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    lane_sums((const uint8_t *)src.buf, NULL, (size_t)src.len, first, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return Py_BuildValue("(kk)", (unsigned long)out[0], (unsigned long)out[1]);
}

static PyObject *py_copy_lane_sums(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    unsigned long long first;
    uint32_t out[2];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*K", &src, &dst, &first))
        return NULL;
    if (src.len != dst.len) {
        PyErr_Format(PyExc_ValueError, "copy_lane_sums: source of %zd bytes, destination of %zd bytes", src.len,
                     dst.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    lane_sums((const uint8_t *)src.buf, (uint8_t *)dst.buf, (size_t)src.len, first, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return Py_BuildValue("(kk)", (unsigned long)out[0], (unsigned long)out[1]);
}

static PyMethodDef methods[] = {
    {"lane_sums", py_lane_sums, METH_VARARGS,
     "lane_sums(buffer, first_index) -> (h0, h1): the mfh64 lane sums of a contiguous buffer's bytes (the last "
     "word zero-padded) whose first word has index first_index."},
    {"copy_lane_sums", py_copy_lane_sums, METH_VARARGS,
     "copy_lane_sums(src, dst, first_index) -> (h0, h1): copy src into dst (same length) and return the lane "
     "sums of the bytes copied, in one pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mfh64", "mfh64 lane sums in C (optional).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mfh64(void) { return PyModule_Create(&module); }
