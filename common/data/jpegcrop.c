/* A JPEG's crop box decoded alone, with libjpeg-turbo's jpeg_crop_scanline and jpeg_skip_scanlines,
 * into a caller's buffer: the pixels torchvision.io.decode_jpeg gives for those rows and columns
 * (at reduce 2, 4 or 8, those of libjpeg's DCT-scaled decode, which PIL's draft gives).
 *
 * Compiled at first use by common/data/jpegcrop.py and called through ctypes. It decodes the way
 * decode_jpeg does (libjpeg's defaults: ISLOW IDCT, fancy upsampling; its source manager, under
 * which a file that ends early is an error, not a grey fill), and reads the file through to its EOI
 * marker, so a file that decode_jpeg refuses is refused here too. Around the box it decodes a
 * margin of one iMCU left, right and above: the upsampling of subsampled chroma at a cropped
 * edge replicates the edge instead of reading the neighbour, so only pixels at least one iMCU
 * inside a cropped edge are decode_jpeg's (below the box none is needed: the rows are read in
 * order, each with the context a whole decode gives it); the caller slices the box out.
 */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

enum { DECODED = 0, NOT_HANDLED = 1, FAILED = 2 };

struct failure {
  struct jpeg_error_mgr pub;
  jmp_buf back;
  char *message;
};

static void fail(j_common_ptr cinfo) {
  struct failure *f = (struct failure *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, f->message);
  longjmp(f->back, 1);
}

static void quiet(j_common_ptr cinfo) { (void)cinfo; } /* warnings: decode_jpeg's pixels, no stderr per image */

static const JOCTET EOI[2] = {0xFF, JPEG_EOI};

static void init_source(j_decompress_ptr cinfo) { (void)cinfo; }
static void term_source(j_decompress_ptr cinfo) { (void)cinfo; }

static boolean no_more_data(j_decompress_ptr cinfo) {  /* what decode_jpeg's source manager does */
  struct failure *f = (struct failure *)cinfo->err;
  strcpy(f->message, "Image is incomplete or truncated");
  longjmp(f->back, 1);
  return FALSE;
}

static void skip_input(j_decompress_ptr cinfo, long count) {
  struct jpeg_source_mgr *src = cinfo->src;
  if (count <= 0) return;
  if (src->bytes_in_buffer < (size_t)count) {  /* past the end: an EOI, as decode_jpeg's manager does */
    src->next_input_byte = EOI + 1;
    src->bytes_in_buffer = 1;
  } else {
    src->next_input_byte += count;
    src->bytes_in_buffer -= (size_t)count;
  }
}

static int clamp(long value, long low, long high) {
  return (int)(value < low ? low : value > high ? high : value);
}

/* Decodes, at 1/reduce of its size, rows and columns of `data` that hold the box (top, left,
 * height, width: of the reduced image) of an image that must be expect_height x expect_width, as `channels` (1: grey, 3: RGB) uint8 HWC into `out`
 * (`capacity` bytes). region[0..3] receives the decoded region's (top, left, height, width).
 * DECODED; NOT_HANDLED where decode_jpeg must decode it (a progressive or multi-scan file, CMYK,
 * other dimensions, a region over `capacity`: `message` says which); FAILED with libjpeg's
 * message (JMSG_LENGTH_MAX bytes) for a file libjpeg refuses. */
int jpegcrop_decode(const unsigned char *data, unsigned long size, int channels, int reduce, int expect_height,
                    int expect_width, int top, int left, int height, int width, unsigned char *out,
                    unsigned long capacity, int *region, char *message) {
  struct jpeg_decompress_struct cinfo;
  struct failure failure;
  struct jpeg_source_mgr source;
  JDIMENSION x0, columns, y0, y1, stride, margin_x, margin_y;

  cinfo.err = jpeg_std_error(&failure.pub);
  failure.pub.error_exit = fail;
  failure.pub.output_message = quiet;
  failure.message = message;
  message[0] = '\0';
  if (setjmp(failure.back)) {
    jpeg_destroy_decompress(&cinfo);
    return FAILED;
  }
  jpeg_create_decompress(&cinfo);
  source.init_source = init_source;
  source.fill_input_buffer = no_more_data;
  source.skip_input_data = skip_input;
  source.resync_to_restart = jpeg_resync_to_restart;
  source.term_source = term_source;
  source.next_input_byte = data;
  source.bytes_in_buffer = size;
  cinfo.src = &source;
  jpeg_read_header(&cinfo, TRUE);

  if (jpeg_has_multiple_scans(&cinfo) || cinfo.data_precision != 8 || cinfo.num_components == 4 ||
      (int)cinfo.image_height != expect_height || (int)cinfo.image_width != expect_width) {
    strcpy(message, "progressive or multi-scan, not 8-bit, 4 components, or other dimensions");
    jpeg_destroy_decompress(&cinfo);
    return NOT_HANDLED;
  }
  if (channels == 1 && cinfo.jpeg_color_space != JCS_GRAYSCALE) cinfo.out_color_space = JCS_GRAYSCALE;
  if (channels == 3 && cinfo.jpeg_color_space != JCS_RGB) cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)reduce;
  jpeg_start_decompress(&cinfo);
  if ((int)cinfo.output_components != channels) {
    strcpy(message, "another channel count");
    jpeg_destroy_decompress(&cinfo);
    return NOT_HANDLED;
  }

  margin_x = (JDIMENSION)(DCTSIZE * cinfo.max_h_samp_factor);
  margin_y = (JDIMENSION)(DCTSIZE * cinfo.max_v_samp_factor);
  x0 = (JDIMENSION)clamp((long)left - margin_x, 0, cinfo.output_width - 1);
  columns = (JDIMENSION)clamp((long)left + width + margin_x, 1, cinfo.output_width) - x0;
  y0 = (JDIMENSION)clamp((long)top - margin_y, 0, cinfo.output_height - 1);
  y1 = (JDIMENSION)clamp((long)top + height, 1, cinfo.output_height);  /* rows below are read as decode_jpeg reads them */
  jpeg_crop_scanline(&cinfo, &x0, &columns);  /* x0 moves left to an iMCU boundary, columns grows by as much */
  stride = columns * (JDIMENSION)channels;
  if ((unsigned long)stride * (y1 - y0) > capacity) {
    strcpy(message, "the region is larger than the buffer");
    jpeg_destroy_decompress(&cinfo);
    return NOT_HANDLED;
  }
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, y0);
  while (cinfo.output_scanline < y1) {
    JSAMPROW row = out + (size_t)(cinfo.output_scanline - y0) * stride;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  /* The rest is entropy-decoded (skipped: not transformed) to the end, as decode_jpeg reads it, so
   * that a file cut short or broken after the box fails here as it fails there. Skipping to the
   * last line would end the input unread: the last line is read, into a scratch row. */
  if (cinfo.output_scanline < cinfo.output_height) {
    JSAMPARRAY last = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, stride, 1);
    if (cinfo.output_height - 1 > cinfo.output_scanline)
      jpeg_skip_scanlines(&cinfo, cinfo.output_height - 1 - cinfo.output_scanline);
    jpeg_read_scanlines(&cinfo, last, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  region[0] = (int)y0;
  region[1] = (int)x0;
  region[2] = (int)(y1 - y0);
  region[3] = (int)columns;
  return DECODED;
}
