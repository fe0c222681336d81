/*
 * ui_page.h -- the chat page served at / (src/server/ui/index.html, one
 * static HTML file with its CSS and script inline; the build turns it into
 * a C array with tools/embed.c, so nothing is read or fetched at run time).
 */
#ifndef K3_SERVER_UI_PAGE_H
#define K3_SERVER_UI_PAGE_H

#include <stddef.h>

extern const unsigned char k3_ui_index_html[];
extern const size_t k3_ui_index_html_len;

#endif /* K3_SERVER_UI_PAGE_H */
