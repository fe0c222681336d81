/*
 * cmp_logits.c -- build/k3-cmp A B TOL: compares two float32 logit dumps
 * (k3 run --dump-logits) and exits 0 when they have the same length and
 * rel-L2 ||A-B|| / ||A|| <= TOL. Prints the figures. For tests/mpi.sh.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float *load(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    float *v = malloc((size_t)(bytes > 0 ? bytes : 1));
    *n = bytes / 4;
    if (!v || fread(v, 4, (size_t)*n, f) != (size_t)*n) {
        free(v);
        v = NULL;
    }
    fclose(f);
    return v;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: k3-cmp A.bin B.bin TOL\n");
        return 2;
    }
    long na = 0, nb = 0;
    float *a = load(argv[1], &na), *b = load(argv[2], &nb);
    if (!a || !b || na != nb || na == 0) {
        fprintf(stderr, "k3-cmp: cannot read both files, or their lengths differ (%ld, %ld floats)\n", na, nb);
        return 1;
    }
    double d = 0, s = 0, mx = 0;
    for (long i = 0; i < na; i++) {
        const double e = (double)a[i] - b[i];
        d += e * e;
        s += (double)a[i] * a[i];
        if (fabs(e) > mx) mx = fabs(e);
    }
    const double rel = sqrt(d) / (sqrt(s) > 0 ? sqrt(s) : 1);
    const double tol = atof(argv[3]);
    printf("rel-L2 %.3g, max abs %.3g over %ld values (tolerance %g)\n", rel, mx, na, tol);
    free(a);
    free(b);
    return rel <= tol && rel == rel ? 0 : 1;
}
