// apps/report.h: base64 against RFC 4648's test vectors, HTML escaping, and the page's shape.
#include <doctest/doctest.h>

#include <string>

#include "report.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace apps_test_report {

using slide::apps::base64;
using slide::apps::html_escape;
using slide::apps::HtmlReport;

TEST_CASE("report: base64 is RFC 4648's (section 10 test vectors, and every byte value)") {
  CHECK(base64("") == "");
  CHECK(base64("f") == "Zg==");
  CHECK(base64("fo") == "Zm8=");
  CHECK(base64("foo") == "Zm9v");
  CHECK(base64("foob") == "Zm9vYg==");
  CHECK(base64("fooba") == "Zm9vYmE=");
  CHECK(base64("foobar") == "Zm9vYmFy");
  // Bytes above 0x7f (a PNG's signature) are not sign-extended.
  CHECK(base64(std::string("\x89PNG\r\n\x1a\n", 8)) == "iVBORw0KGgo=");
  CHECK(base64(std::string("\xff\xfe\xfd", 3)) == "//79");
}

TEST_CASE("report: html_escape escapes markup and replaces invalid UTF-8") {
  CHECK(html_escape("a<b>&\"c\"'d'") == "a&lt;b&gt;&amp;&quot;c&quot;&#39;d&#39;");
  CHECK(html_escape("caf\xc3\xa9 \xe2\x82\xac") == "caf\xc3\xa9 \xe2\x82\xac");    // valid: kept
  CHECK(html_escape("x\xffy") == "x\xef\xbf\xbdy");                                   // a stray byte
  CHECK(html_escape("\xc0\xaf") == "\xef\xbf\xbd\xef\xbf\xbd");                       // an overlong '/'
  CHECK(html_escape("\xed\xa0\x80") == "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");       // a surrogate
  CHECK(html_escape("\xe2\x82") == "\xef\xbf\xbd\xef\xbf\xbd");                       // cut short
}

TEST_CASE("report: a page with a title, tables and an inline image, every text escaped") {
  HtmlReport r("run <1>");
  r.heading("Epochs & more");
  r.key_values({{"model", "resnet18"}}, "run");
  r.table({"class", "recall"}, {{"tumour", "0.9"}, {"<stroma>", "n/a"}}, "classes", true);
  r.png(std::string("\x89PNG", 4), "curves");
  const std::string h = r.html();
  CHECK(h.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(h.find("<title>run &lt;1&gt;</title>") != std::string::npos);
  CHECK(h.find("<h2>Epochs &amp; more</h2>") != std::string::npos);
  CHECK(h.find("<table class=\"kv\" id=\"run\">") != std::string::npos);
  CHECK(h.find("<tr><th>&lt;stroma&gt;</th><td>n/a</td></tr>") != std::string::npos);
  CHECK(h.find("src=\"data:image/png;base64,iVBORw==\"") != std::string::npos);
  CHECK(h.find("<script") == std::string::npos);
  CHECK(h.find("http") == std::string::npos);  // nothing fetched
}

}  // namespace apps_test_report
