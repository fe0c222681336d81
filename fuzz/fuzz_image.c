/* fuzz_image.c -- libFuzzer harness: image bytes (PNG, JPEG, WEBP or GIF) through
 * k3_image_decode (capped at 2^20 pixels), then the K3 processor with a
 * small patch budget so that resizing, the chessboard and padding run:
 * bad input must give an error, never a crash or a read out of bounds. */
#include <stdint.h>
#include <stdlib.h>

#include "fuzz.h"
#include "vision/vision.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_image *im = NULL;
    k3_error err = {0};
    if (k3_image_decode(&im, data, size, (int64_t)1 << 20, &err) != K3_OK) return 0;
    k3_image_proc p;
    k3_image_proc_defaults(&p);
    p.in_patch_limit = 64;
    p.side_limit = 16;
    k3_resize_plan plan;
    uint8_t *rgb = NULL;
    if (k3_image_proc_plan(&p, im->width, im->height, &plan, &err) == K3_OK &&
        k3_image_proc_rgb(&p, im, &plan, &rgb, &err) == K3_OK) {
        float *px = malloc(sizeof(float) * (size_t)plan.grid_h * plan.grid_w * 3 * 14 * 14);
        if (px) k3_image_proc_patchify(&p, rgb, &plan, px);
        free(px);
    }
    (void)k3_image_hash(im);
    free(rgb);
    k3_image_free(im);
    return 0;
}
