/*
 * image.c -- PNG (libpng), JPEG (libjpeg-turbo), WEBP (libwebp) and GIF
 * (giflib) decoding into k3_image.
 *
 * The decoded form keeps what PIL's Image.open would know, because the K3
 * processor resizes the image in its original mode (transparent_bg_fill_stage
 * "after_resize"): an 8-bit RGBA buffer plus the PIL mode it stands for.
 *   PNG grey 1/2/4/8   -> "L" (1-bit is PIL "1": resized NEAREST)  -> RGB
 *   PNG grey + tRNS    -> "L" with a transparency key               -> GREY_KEY
 *   PNG grey+alpha     -> "LA"                                      -> RGBA
 *   PNG RGB 8/16       -> "RGB" (16-bit: the high byte, as PIL's RGB;16B);
 *                         a tRNS colour key is ignored, as fill_transparent_bg_with does for RGB
 *   PNG RGBA 8/16      -> "RGBA"
 *   PNG palette        -> "P" (resized NEAREST), alpha from tRNS    -> PALETTE
 *   JPEG grey / YCbCr  -> "L" / "RGB"; CMYK and YCCK are refused.
 *   WEBP               -> the first frame as libwebp's animation decoder
 *                         composes it on the canvas (what Pillow reads):
 *                         "RGBA" when the file says it has alpha, else "RGB"
 *   GIF                -> the first frame on the logical screen (grown to hold
 *                         the frame, as Pillow does), as GifImagePlugin does:
 *                         "P" with the frame's palette (local, else global),
 *                         alpha 0 at the transparency index; "L" when that
 *                         palette is the identity grey ramp (entry i = (i,i,i))
 *                         or there is none, the transparency index then a grey
 *                         key; outside the frame, the transparency index (or 0)
 *                         -> PALETTE, or RGB / GREY_KEY for "L"
 * Sizes are checked against the pixel cap after the header and before any
 * pixel data is inflated, so a decompression bomb costs a header read.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <gif_lib.h>
#include <jpeglib.h>
#include <jerror.h>
#include <png.h>
#include <webp/decode.h>
#include <webp/demux.h>

#include "common/error.h"
#include "vision/vision.h"

/* The largest side any processor config can use before the resize: the
 * per-side cap is patch_limit_on_one_side * patch_size (7168 in the release)
 * on the *output*; inputs may be larger, but not absurdly so. */
#define K3_IMAGE_MAX_SIDE 65535

static k3_status check_size(uint32_t w, uint32_t h, int64_t max_pixels, const char *what, k3_error *err) {
    if (max_pixels <= 0) max_pixels = K3_IMAGE_MAX_PIXELS;
    if (w == 0 || h == 0) return k3_err(err, K3_ERR_FORMAT, "%s: the image is %ux%u pixels", what, w, h);
    if (w > K3_IMAGE_MAX_SIDE || h > K3_IMAGE_MAX_SIDE || (int64_t)w * h > max_pixels)
        return k3_err(err, K3_ERR_RANGE, "%s: the image is %ux%u pixels, over the limit of %lld pixels (%d a side)",
                      what, w, h, (long long)max_pixels, K3_IMAGE_MAX_SIDE);
    return K3_OK;
}

static k3_image *image_new(uint32_t w, uint32_t h) {
    k3_image *im = calloc(1, sizeof *im);
    if (!im) return NULL;
    im->width = (int32_t)w;
    im->height = (int32_t)h;
    im->px = malloc((size_t)w * h * 4);
    if (!im->px) {
        free(im);
        return NULL;
    }
    return im;
}

k3_status k3_image_from_rgba(k3_image **out, const uint8_t *rgba, int32_t width, int32_t height, bool has_alpha,
                             k3_error *err) {
    if (!out || !rgba) return k3_err(err, K3_ERR_ARG, "image: no pixels");
    *out = NULL;
    if (width < 1 || height < 1) return k3_err(err, K3_ERR_ARG, "image: bad size %dx%d", width, height);
    k3_status s = check_size((uint32_t)width, (uint32_t)height, 0, "image", err);
    if (s) return s;
    k3_image *im = image_new((uint32_t)width, (uint32_t)height);
    if (!im) return k3_err(err, K3_ERR_NOMEM, "image: out of memory for %dx%d pixels", width, height);
    memcpy(im->px, rgba, (size_t)width * height * 4);
    im->mode = has_alpha ? K3_IMODE_RGBA : K3_IMODE_RGB;
    if (!has_alpha)
        for (size_t i = 0; i < (size_t)width * height; i++) im->px[4 * i + 3] = 255;
    *out = im;
    return K3_OK;
}

void k3_image_free(k3_image *im) {
    if (!im) return;
    free(im->px);
    free(im);
}

int32_t k3_image_width(const k3_image *im) { return im ? im->width : 0; }
int32_t k3_image_height(const k3_image *im) { return im ? im->height : 0; }

uint64_t k3_image_hash(const k3_image *im) {
    /* FNV-1a over a header (size, mode, key) and the pixels */
    uint64_t h = 1469598103934665603ull;
    const uint8_t hdr[] = {(uint8_t)im->width,  (uint8_t)(im->width >> 8),  (uint8_t)(im->width >> 16),
                           (uint8_t)im->height, (uint8_t)(im->height >> 8), (uint8_t)(im->height >> 16),
                           (uint8_t)im->mode,   (uint8_t)im->has_alpha,     im->key};
    for (size_t i = 0; i < sizeof hdr; i++) h = (h ^ hdr[i]) * 1099511628211ull;
    const size_t n = (size_t)im->width * im->height * 4;
    for (size_t i = 0; i < n; i++) h = (h ^ im->px[i]) * 1099511628211ull;
    return h;
}

/* ---- PNG ------------------------------------------------------------------ */

typedef struct png_src {
    const uint8_t *p;
    size_t n, off;
    jmp_buf jb;
    char msg[200];
} png_src;

static void png_read_mem(png_structp png, png_bytep out, png_size_t len) {
    png_src *s = png_get_io_ptr(png);
    if (len > s->n - s->off) {
        snprintf(s->msg, sizeof s->msg, "the file is truncated");
        png_error(png, "truncated");
    }
    memcpy(out, s->p + s->off, len);
    s->off += len;
}

static void png_on_error(png_structp png, png_const_charp msg) {
    png_src *s = png_get_error_ptr(png);
    if (!s->msg[0]) snprintf(s->msg, sizeof s->msg, "%s", msg);
    longjmp(s->jb, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg) { (void)png, (void)msg; }

static k3_status decode_png(k3_image **out, const uint8_t *data, size_t size, int64_t max_pixels, const char *what,
                            int32_t *dims, k3_error *err) {
    /* IHDR must come first: its size is checked before libpng reads on
     * (png_read_info reads every chunk up to the image data) */
    if (size >= 24 && !memcmp(data + 12, "IHDR", 4)) {
        const uint32_t w0 = (uint32_t)data[16] << 24 | (uint32_t)data[17] << 16 | (uint32_t)data[18] << 8 | data[19];
        const uint32_t h0 = (uint32_t)data[20] << 24 | (uint32_t)data[21] << 16 | (uint32_t)data[22] << 8 | data[23];
        k3_status s0 = check_size(w0, h0, max_pixels, what, err);
        if (s0) return s0;
    }
    png_src src = {.p = data, .n = size};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_read_struct(&png, NULL, NULL);
        return k3_err(err, K3_ERR_NOMEM, "%s: out of memory", what);
    }
    /* volatile: set between setjmp and a longjmp back */
    k3_image *volatile im = NULL;
    png_bytep *volatile rows = NULL;
    uint8_t *volatile buf = NULL;
    k3_status st = K3_OK;
    if (setjmp(src.jb)) {
        st = k3_err(err, K3_ERR_FORMAT, "%s: bad PNG: %s", what, src.msg);
        goto done;
    }
    png_set_read_fn(png, &src, png_read_mem);
    png_set_user_limits(png, K3_IMAGE_MAX_SIDE, K3_IMAGE_MAX_SIDE);
    png_set_chunk_malloc_max(png, 8u << 20); /* ancillary chunks (iCCP, zTXt): no bombs */
    png_read_info(png, info);
    uint32_t w = png_get_image_width(png, info), h = png_get_image_height(png, info);
    int depth = png_get_bit_depth(png, info), ct = png_get_color_type(png, info);
    if ((st = check_size(w, h, max_pixels, what, err))) goto done;
    if (dims) { /* a probe: the size, nothing decoded */
        dims[0] = (int32_t)w, dims[1] = (int32_t)h;
        goto done;
    }
    if ((ct == PNG_COLOR_TYPE_GRAY || ct == PNG_COLOR_TYPE_GRAY_ALPHA) && depth == 16) {
        st = k3_err(err, K3_ERR_UNSUPPORTED, "%s: 16-bit greyscale PNG is not supported (PIL reads it as mode I;16)",
                    what);
        goto done;
    }
    im = image_new(w, h);
    if (!im) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %ux%u pixels", what, w, h);
        goto done;
    }
    im->mode = K3_IMODE_RGB;
    png_bytep trans = NULL;
    int n_trans = 0;
    png_color_16p trans_col = NULL;
    const bool has_trns = png_get_tRNS(png, info, &trans, &n_trans, &trans_col) != 0;
    png_colorp pal = NULL;
    int n_pal = 0;
    if (ct == PNG_COLOR_TYPE_PALETTE) {
        if (!png_get_PLTE(png, info, &pal, &n_pal)) {
            st = k3_err(err, K3_ERR_FORMAT, "%s: bad PNG: a palette image without a palette", what);
            goto done;
        }
        /* keep indices: the palette is applied below, so tRNS alpha is known per index */
        if (depth < 8) png_set_packing(png);
        im->mode = K3_IMODE_PALETTE;
        im->has_alpha = has_trns;
    } else {
        if (depth == 16) png_set_strip_16(png); /* the high byte, as PIL's ;16B unpackers */
        if (ct == PNG_COLOR_TYPE_GRAY || ct == PNG_COLOR_TYPE_GRAY_ALPHA) {
            im->grey = true;
            if (depth < 8) png_set_expand_gray_1_2_4_to_8(png); /* v * 255 / (2^d - 1), as PIL's L;2 / L;4 */
            if (ct == PNG_COLOR_TYPE_GRAY && depth == 1) im->mode = K3_IMODE_PALETTE; /* PIL "1": NEAREST */
            /* PIL keeps the raw tRNS value as the key, unscaled for 2/4-bit grey */
            if (ct == PNG_COLOR_TYPE_GRAY && has_trns && trans_col && depth > 1 && trans_col->gray < 256) {
                im->mode = K3_IMODE_GREY_KEY;
                im->key = (uint8_t)trans_col->gray;
            }
            png_set_gray_to_rgb(png);
        }
        if (ct == PNG_COLOR_TYPE_GRAY_ALPHA || ct == PNG_COLOR_TYPE_RGB_ALPHA) im->mode = K3_IMODE_RGBA;
        else png_set_filler(png, 0xff, PNG_FILLER_AFTER);
    }
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    const size_t rb = png_get_rowbytes(png, info);
    if (rb != (ct == PNG_COLOR_TYPE_PALETTE ? (size_t)w : (size_t)w * 4)) {
        snprintf(src.msg, sizeof src.msg, "unexpected row layout");
        png_error(png, "layout");
    }
    /* RGBA rows straight into the image; palette indices into a buffer first */
    if (ct == PNG_COLOR_TYPE_PALETTE) buf = malloc(rb * h);
    rows = malloc(sizeof(png_bytep) * h);
    if ((ct == PNG_COLOR_TYPE_PALETTE && !buf) || !rows) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %ux%u pixels", what, w, h);
        goto done;
    }
    for (uint32_t y = 0; y < h; y++) rows[y] = (buf ? buf : im->px) + rb * y;
    png_read_image(png, rows);
    if (ct == PNG_COLOR_TYPE_PALETTE) {
        for (size_t i = 0; i < (size_t)w * h; i++) {
            const int c = buf[i];
            uint8_t *o = im->px + 4 * i;
            if (c < n_pal) o[0] = pal[c].red, o[1] = pal[c].green, o[2] = pal[c].blue;
            else o[0] = o[1] = o[2] = 0; /* Pillow 13: ImagingPaletteNew zeroes the table */
            o[3] = has_trns && c < n_trans ? trans[c] : 255;
        }
    } else {
        if (im->mode == K3_IMODE_PALETTE) { /* 1-bit grey ("1"): values 0 or 255; a tRNS key (PIL: 255 if
                                               nonzero) makes those pixels transparent */
            const bool key = has_trns && trans_col, key_on = key && trans_col->gray != 0;
            im->has_alpha = key;
            for (size_t i = 0; i < (size_t)w * h; i++)
                im->px[4 * i + 3] = key && (im->px[4 * i] != 0) == key_on ? 0 : 255;
        }
    }
done:
    png_destroy_read_struct(&png, &info, NULL);
    free(buf);
    free(rows);
    if (st) {
        k3_image_free(im);
        return st;
    }
    *out = im;
    return K3_OK;
}

/* ---- JPEG ----------------------------------------------------------------- */

typedef struct jpeg_err {
    struct jpeg_error_mgr mgr;
    jmp_buf jb;
    char msg[JMSG_LENGTH_MAX];
} jpeg_err;

static void jpeg_on_error(j_common_ptr c) {
    jpeg_err *e = (jpeg_err *)c->err;
    if (!e->msg[0]) (*c->err->format_message)(c, e->msg);
    longjmp(e->jb, 1);
}

static void jpeg_on_message(j_common_ptr c, int level) {
    /* A truncated file is only a warning to libjpeg (it pads with grey);
     * PIL refuses it ("image file is truncated"), and so does k3. */
    if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF) {
        jpeg_err *e = (jpeg_err *)c->err;
        snprintf(e->msg, sizeof e->msg, "the file is truncated");
        longjmp(e->jb, 1);
    }
}

static k3_status decode_jpeg(k3_image **out, const uint8_t *data, size_t size, int64_t max_pixels, const char *what,
                             int32_t *dims, k3_error *err) {
    struct jpeg_decompress_struct cinfo;
    jpeg_err je;
    memset(&je, 0, sizeof je);
    cinfo.err = jpeg_std_error(&je.mgr);
    je.mgr.error_exit = jpeg_on_error;
    je.mgr.emit_message = jpeg_on_message;
    k3_image *volatile im = NULL;
    uint8_t *volatile row = NULL;
    k3_status st = K3_OK;
    if (setjmp(je.jb)) {
        st = k3_err(err, K3_ERR_FORMAT, "%s: bad JPEG: %s", what, je.msg);
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if ((st = check_size(cinfo.image_width, cinfo.image_height, max_pixels, what, err))) goto done;
    if (dims) { /* a probe: the size, nothing decoded */
        dims[0] = (int32_t)cinfo.image_width, dims[1] = (int32_t)cinfo.image_height;
        goto done;
    }
    const J_COLOR_SPACE cs = cinfo.jpeg_color_space;
    if (cs == JCS_CMYK || cs == JCS_YCCK) {
        st = k3_err(err, K3_ERR_UNSUPPORTED, "%s: CMYK JPEG is not supported", what);
        goto done;
    }
    const bool grey = cs == JCS_GRAYSCALE;
    cinfo.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
    jpeg_start_decompress(&cinfo);
    const uint32_t w = cinfo.output_width, h = cinfo.output_height;
    im = image_new(w, h);
    row = malloc((size_t)w * 3);
    if (!im || !row) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %ux%u pixels", what, w, h);
        goto done;
    }
    im->mode = K3_IMODE_RGB;
    im->grey = grey;
    while (cinfo.output_scanline < h) {
        const uint32_t y = cinfo.output_scanline;
        JSAMPROW r = row;
        if (jpeg_read_scanlines(&cinfo, &r, 1) != 1) {
            snprintf(je.msg, sizeof je.msg, "no scanline %u", y);
            longjmp(je.jb, 1);
        }
        uint8_t *o = im->px + (size_t)y * w * 4;
        for (uint32_t x = 0; x < w; x++) {
            if (grey) o[4 * x] = o[4 * x + 1] = o[4 * x + 2] = row[x];
            else o[4 * x] = row[3 * x], o[4 * x + 1] = row[3 * x + 1], o[4 * x + 2] = row[3 * x + 2];
            o[4 * x + 3] = 255;
        }
    }
    jpeg_finish_decompress(&cinfo);
done:
    jpeg_destroy_decompress(&cinfo);
    free(row);
    if (st) {
        k3_image_free(im);
        return st;
    }
    *out = im;
    return K3_OK;
}

/* ---- WEBP ----------------------------------------------------------------- */

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static k3_status decode_webp(k3_image **out, const uint8_t *data, size_t size, int64_t max_pixels, const char *what,
                             int32_t *dims, k3_error *err) {
    /* the RIFF header says how long the file is: a shorter one was cut */
    const bool cut = size < 12 || (uint64_t)le32(data + 4) + 8 > size;
    WebPBitstreamFeatures f;
    const VP8StatusCode vs = WebPGetFeatures(data, size, &f);
    if (vs != VP8_STATUS_OK)
        return k3_err(err, K3_ERR_FORMAT, "%s: bad WEBP: %s", what,
                      cut || vs == VP8_STATUS_NOT_ENOUGH_DATA    ? "the file is truncated"
                          : vs == VP8_STATUS_UNSUPPORTED_FEATURE ? "a feature libwebp does not read"
                                                                 : "the header is corrupt");
    /* the canvas (VP8X) or the image: checked before the decoder allocates it */
    k3_status st = check_size((uint32_t)f.width, (uint32_t)f.height, max_pixels, what, err);
    if (st) return st;
    if (cut) return k3_err(err, K3_ERR_FORMAT, "%s: bad WEBP: the file is truncated", what);
    if (dims) { /* a probe: the size (the canvas of an animation), nothing decoded */
        dims[0] = f.width, dims[1] = f.height;
        return K3_OK;
    }
    /* Pillow reads every WEBP, still or animated, through the animation
     * decoder in its default RGBA mode and calls it "RGBA" when the
     * bitstream features say alpha, else "RGB" (the fourth byte dropped) */
    WebPAnimDecoderOptions opt;
    if (!WebPAnimDecoderOptionsInit(&opt))
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s: the libwebp library does not match its headers", what);
    opt.color_mode = MODE_RGBA;
    opt.use_threads = 0;
    const WebPData wd = {data, size};
    WebPAnimDecoder *dec = WebPAnimDecoderNew(&wd, &opt);
    if (!dec) return k3_err(err, K3_ERR_FORMAT, "%s: bad WEBP: the container is corrupt", what);
    k3_image *im = NULL;
    WebPAnimInfo info;
    uint8_t *canvas = NULL;
    int ts = 0;
    if (!WebPAnimDecoderGetInfo(dec, &info)) {
        st = k3_err(err, K3_ERR_FORMAT, "%s: bad WEBP: the container is corrupt", what);
        goto done;
    }
    if ((st = check_size(info.canvas_width, info.canvas_height, max_pixels, what, err))) goto done;
    if (!WebPAnimDecoderGetNext(dec, &canvas, &ts) || !canvas) {
        st = k3_err(err, K3_ERR_FORMAT, "%s: bad WEBP: the first frame does not decode (corrupt data)", what);
        goto done;
    }
    im = image_new(info.canvas_width, info.canvas_height);
    if (!im) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %ux%u pixels", what, info.canvas_width,
                    info.canvas_height);
        goto done;
    }
    const size_t n = (size_t)info.canvas_width * info.canvas_height;
    memcpy(im->px, canvas, n * 4);
    im->mode = f.has_alpha ? K3_IMODE_RGBA : K3_IMODE_RGB;
    if (!f.has_alpha)
        for (size_t i = 0; i < n; i++) im->px[4 * i + 3] = 255;
done:
    WebPAnimDecoderDelete(dec);
    if (st) {
        k3_image_free(im);
        return st;
    }
    *out = im;
    return K3_OK;
}

/* ---- GIF ------------------------------------------------------------------ */

typedef struct gif_src {
    const uint8_t *p;
    size_t n, off;
    bool cut; /* a read asked for bytes past the end */
} gif_src;

static int gif_read(GifFileType *g, GifByteType *buf, int len) {
    gif_src *s = g->UserData;
    size_t k = len > 0 ? (size_t)len : 0;
    if (k > s->n - s->off) {
        k = s->n - s->off;
        s->cut = true;
    }
    memcpy(buf, s->p + s->off, k);
    s->off += k;
    return (int)k;
}

static k3_status gif_fail(k3_error *err, const char *what, const gif_src *s, int code) {
    if (s->cut) return k3_err(err, K3_ERR_FORMAT, "%s: bad GIF: the file is truncated", what);
    const char *m = code ? GifErrorString(code) : NULL;
    char low[128];
    snprintf(low, sizeof low, "%s", m ? m : "corrupt data");
    if (low[0] >= 'A' && low[0] <= 'Z') low[0] = (char)(low[0] - 'A' + 'a');
    return k3_err(err, K3_ERR_FORMAT, "%s: bad GIF: %s", what, low);
}

/* GifImagePlugin keeps a palette only when it is not the identity grey
 * ramp (entry i = (i, i, i)); without one the frame is "L". */
static bool gif_palette_needed(const ColorMapObject *m) {
    for (int i = 0; i < m->ColorCount; i++)
        if (m->Colors[i].Red != i || m->Colors[i].Green != i || m->Colors[i].Blue != i) return true;
    return false;
}

static k3_status decode_gif(k3_image **out, const uint8_t *data, size_t size, int64_t max_pixels, const char *what,
                            int32_t *dims, k3_error *err) {
    gif_src src = {.p = data, .n = size};
    int e = 0;
    GifFileType *g = DGifOpen(&src, gif_read, &e);
    if (!g) return gif_fail(err, what, &src, e);
    k3_image *im = NULL;
    uint8_t *idx = NULL, *line = NULL;
    k3_status st = K3_OK;
    int trns = -1; /* the last graphic control extension before the frame */
    /* the records up to the first image descriptor */
    for (;;) {
        GifRecordType rt;
        if (DGifGetRecordType(g, &rt) == GIF_ERROR) {
            st = gif_fail(err, what, &src, g->Error);
            goto done;
        }
        if (rt == IMAGE_DESC_RECORD_TYPE) {
            if (DGifGetImageDesc(g) == GIF_ERROR) {
                st = gif_fail(err, what, &src, g->Error);
                goto done;
            }
            break;
        }
        if (rt == TERMINATE_RECORD_TYPE) {
            st = k3_err(err, K3_ERR_FORMAT, "%s: bad GIF: the file holds no image", what);
            goto done;
        }
        int code = 0;
        GifByteType *ext = NULL;
        if (DGifGetExtension(g, &code, &ext) == GIF_ERROR) {
            st = gif_fail(err, what, &src, g->Error);
            goto done;
        }
        if (code == GRAPHICS_EXT_FUNC_CODE && ext) { /* ext[0] is the block's length */
            if (ext[0] < 3 || ((ext[1] & 1) && ext[0] < 4)) {
                st = k3_err(err, K3_ERR_FORMAT, "%s: bad GIF: a graphic control block of %d bytes", what, ext[0]);
                goto done;
            }
            if (ext[1] & 1) trns = ext[4];
        }
        while (ext)
            if (DGifGetExtensionNext(g, &ext) == GIF_ERROR) {
                st = gif_fail(err, what, &src, g->Error);
                goto done;
            }
    }
    const GifImageDesc *d = &g->Image;
    const uint32_t x0 = (uint32_t)d->Left, y0 = (uint32_t)d->Top, fw = (uint32_t)d->Width, fh = (uint32_t)d->Height;
    /* the logical screen, grown to hold a frame that reaches past it */
    const uint32_t w = x0 + fw > (uint32_t)g->SWidth ? x0 + fw : (uint32_t)g->SWidth;
    const uint32_t h = y0 + fh > (uint32_t)g->SHeight ? y0 + fh : (uint32_t)g->SHeight;
    if ((st = check_size(w, h, max_pixels, what, err))) goto done;
    if (dims) { /* a probe: the size, nothing decoded */
        dims[0] = (int32_t)w, dims[1] = (int32_t)h;
        goto done;
    }
    /* the frame's palette, else the global one; a ramp is no palette ("L").
     * A local ramp under a global palette Pillow calls "L" but keeps the
     * global palette on the pixels (what convert shows; its resize refuses
     * that image), so those indices go through the global palette here. */
    const ColorMapObject *pal = d->ColorMap && gif_palette_needed(d->ColorMap) ? d->ColorMap
        : g->SColorMap && gif_palette_needed(g->SColorMap)                     ? g->SColorMap
                                                                               : NULL;
    im = image_new(w, h);
    idx = malloc((size_t)w * h);
    line = malloc(fw ? fw : 1);
    if (!im || !idx || !line) {
        st = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %ux%u pixels", what, w, h);
        goto done;
    }
    /* outside the frame: the transparency index, else 0 (Pillow's fill) */
    memset(idx, trns >= 0 ? trns : 0, (size_t)w * h);
    /* rows in the file's order (the four interlace passes, or top down);
     * giflib reads on to the data's end block after the last pixel, so a
     * file cut right before that block (Pillow stops at the last pixel and
     * takes it) is refused as truncated here */
    if (fw && fh) {
        static const uint32_t start[4] = {0, 4, 2, 1}, step[4] = {8, 8, 4, 2};
        const int passes = d->Interlace ? 4 : 1;
        for (int p = 0; p < passes; p++)
            for (uint32_t y = d->Interlace ? start[p] : 0; y < fh; y += d->Interlace ? step[p] : 1) {
                if (DGifGetLine(g, line, (int)fw) == GIF_ERROR) {
                    st = gif_fail(err, what, &src, g->Error);
                    goto done;
                }
                memcpy(idx + (size_t)(y0 + y) * w + x0, line, fw);
            }
    }
    const size_t n = (size_t)w * h;
    if (pal) {
        im->mode = K3_IMODE_PALETTE;
        im->has_alpha = trns >= 0;
        for (size_t i = 0; i < n; i++) {
            const int c = idx[i];
            uint8_t *o = im->px + 4 * i;
            if (c < pal->ColorCount) o[0] = pal->Colors[c].Red, o[1] = pal->Colors[c].Green, o[2] = pal->Colors[c].Blue;
            else o[0] = o[1] = o[2] = 0; /* past the palette: Pillow's zeroed table */
            o[3] = c == trns ? 0 : 255;
        }
    } else {
        im->grey = true;
        im->mode = trns >= 0 ? K3_IMODE_GREY_KEY : K3_IMODE_RGB;
        im->key = trns >= 0 ? (uint8_t)trns : 0;
        for (size_t i = 0; i < n; i++) {
            uint8_t *o = im->px + 4 * i;
            o[0] = o[1] = o[2] = idx[i];
            o[3] = 255;
        }
    }
done:
    DGifCloseFile(g, &e);
    free(idx);
    free(line);
    if (st) {
        k3_image_free(im);
        return st;
    }
    *out = im;
    return K3_OK;
}

/* ---- entry points --------------------------------------------------------- */

/* dims non-NULL: a probe, the size into dims[0..1] and nothing decoded. */
static k3_status decode_named(k3_image **out, const void *data, size_t size, int64_t max_pixels, const char *what,
                              int32_t *dims, k3_error *err) {
    if (!out || (!data && size)) return k3_err(err, K3_ERR_ARG, "%s: no image data", what);
    *out = NULL;
    const uint8_t *p = data;
    static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (size >= 8 && !memcmp(p, png_sig, 8)) return decode_png(out, p, size, max_pixels, what, dims, err);
    if (size >= 3 && p[0] == 0xff && p[1] == 0xd8 && p[2] == 0xff)
        return decode_jpeg(out, p, size, max_pixels, what, dims, err);
    /* RIFF....WEBP and a VP8 / VP8L / VP8X chunk, as Pillow's _accept */
    if (size >= 16 && !memcmp(p, "RIFF", 4) && !memcmp(p + 8, "WEBP", 4) &&
        (!memcmp(p + 12, "VP8 ", 4) || !memcmp(p + 12, "VP8L", 4) || !memcmp(p + 12, "VP8X", 4)))
        return decode_webp(out, p, size, max_pixels, what, dims, err);
    if (size >= 6 && (!memcmp(p, "GIF87a", 6) || !memcmp(p, "GIF89a", 6)))
        return decode_gif(out, p, size, max_pixels, what, dims, err);
    /* cut inside the signature itself */
    if ((size >= 12 && size < 16 && !memcmp(p, "RIFF", 4) && !memcmp(p + 8, "WEBP", 4)) ||
        (size >= 3 && size < 6 && (!memcmp(p, "GIF87a", size) || !memcmp(p, "GIF89a", size))))
        return k3_err(err, K3_ERR_FORMAT, "%s: bad %s: the file is truncated", what, p[0] == 'G' ? "GIF" : "WEBP");
    if (size == 0) return k3_err(err, K3_ERR_FORMAT, "%s: the image is empty", what);
    return k3_err(err, K3_ERR_UNSUPPORTED, "%s: not a PNG, JPEG, WEBP or GIF image", what);
}

k3_status k3_image_decode(k3_image **out, const void *data, size_t size, int64_t max_pixels, k3_error *err) {
    return decode_named(out, data, size, max_pixels, "image", NULL, err);
}

static int b64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62; /* standard and URL-safe alphabets */
    if (c == '/' || c == '_') return 63;
    return -1;
}

static k3_status decode_url(k3_image **out, const char *url, size_t len, int64_t max_pixels, int32_t *dims,
                            k3_error *err) {
    if (out) *out = NULL;
    if (!out || !url) return k3_err(err, K3_ERR_ARG, "image_url: no URL");
    if (len < 5 || strncasecmp(url, "data:", 5)) {
        const char *colon = memchr(url, ':', len < 16 ? len : 16);
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "image_url: only data: URLs are accepted (the server fetches nothing)%s%.*s%s",
                      colon ? "; got a " : "", colon ? (int)(colon - url) : 0, url, colon ? ": URL" : "");
    }
    const char *comma = memchr(url, ',', len);
    if (!comma) return k3_err(err, K3_ERR_ARG, "image_url: a data: URL without a comma");
    const char *meta = url + 5;
    const size_t nmeta = (size_t)(comma - meta);
    if (nmeta < 7 || strncasecmp(comma - 7, ";base64", 7))
        return k3_err(err, K3_ERR_UNSUPPORTED, "image_url: the data: URL is not base64 (';base64,' expected)");
    const size_t ntype = nmeta - 7;
    const char *types[] = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"};
    bool type_ok = ntype == 0;
    for (int i = 0; i < 5 && !type_ok; i++) type_ok = ntype == strlen(types[i]) && !strncasecmp(meta, types[i], ntype);
    if (!type_ok)
        return k3_err(err, K3_ERR_UNSUPPORTED, "image_url: media type '%.*s' is not supported (PNG, JPEG, WEBP or GIF)",
                      (int)(ntype < 64 ? ntype : 64), meta);
    const char *p = comma + 1, *end = url + len;
    /* 1 GB of base64 is far past any image the pixel cap lets through */
    if ((size_t)(end - p) > ((size_t)1 << 30)) return k3_err(err, K3_ERR_RANGE, "image_url: over 1 GB of data");
    uint8_t *buf = malloc((size_t)(end - p) / 4 * 3 + 3);
    if (!buf) return k3_err(err, K3_ERR_NOMEM, "image_url: out of memory");
    size_t n = 0;
    uint32_t acc = 0;
    int bits = 0, pad = 0;
    for (; p < end; p++) {
        const unsigned char c = (unsigned char)*p;
        if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
        if (c == '=') {
            pad++;
            continue;
        }
        const int v = b64_value(c);
        if (v < 0 || pad) {
            free(buf);
            return k3_err(err, K3_ERR_ARG, "image_url: bad base64 at byte %zu of the data", (size_t)(p - comma - 1));
        }
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            buf[n++] = (uint8_t)(acc >> bits);
        }
    }
    if (bits >= 6 || pad > 2) {
        free(buf);
        return k3_err(err, K3_ERR_ARG, "image_url: the base64 data is cut short");
    }
    k3_status s = decode_named(out, buf, n, max_pixels, "image_url", dims, err);
    free(buf);
    return s;
}

k3_status k3_image_decode_url(k3_image **out, const char *url, size_t len, int64_t max_pixels, k3_error *err) {
    return decode_url(out, url, len, max_pixels, NULL, err);
}

k3_status k3_image_probe_url(const char *url, size_t len, int64_t max_pixels, int32_t *width, int32_t *height,
                             k3_error *err) {
    k3_image *im = NULL;
    int32_t dims[2] = {0, 0};
    const k3_status s = decode_url(&im, url, len, max_pixels, dims, err);
    k3_image_free(im);
    *width = dims[0];
    *height = dims[1];
    return s;
}

k3_status k3_image_load(k3_image **out, const char *path, int64_t max_pixels, k3_error *err) {
    if (out) *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return k3_err(err, K3_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    /* the compressed size is bounded too: no image k3 accepts needs 1 GB */
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n < 0 || n > (1l << 30) || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return k3_err(err, n > (1l << 30) ? K3_ERR_RANGE : K3_ERR_IO, "%s: %s", path,
                      n > (1l << 30) ? "over 1 GB" : "cannot read its size");
    }
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf) {
        fclose(f);
        return k3_err(err, K3_ERR_NOMEM, "%s: out of memory", path);
    }
    const bool ok = fread(buf, 1, (size_t)n, f) == (size_t)n;
    fclose(f);
    if (!ok) {
        free(buf);
        return k3_err(err, K3_ERR_IO, "cannot read %s", path);
    }
    k3_status st = decode_named(out, buf, (size_t)n, max_pixels, path, NULL, err);
    free(buf);
    return st;
}
