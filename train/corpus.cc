// The corpus pipeline: list documents (Debian packages or a directory; documentation formats converted to
// text, files optionally joined into long documents), split and order them by hashes of their names, train or
// copy the tokenizer, tokenise into shards (code capped to a share of the tokens), write the manifest; and
// pack/unpack.
#include "train/corpus.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "train/data_subprocess.h"
#include "train/sha256.h"
#include "train/shards.h"
#include "engine/json_text.h"

namespace oryx {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// --- sources -----------------------------------------------------------------------------------------

// How a source finds its documents. Either the first package ships a source tarball (linux-source),
// unpacked into the work directory, or the documents are files the packages install under `root`.
struct SourceDef {
  CorpusSourceInfo info;
  bool from_tarball = false;
  std::string root;  // installed files: absolute prefix; document ids are relative to it
  std::vector<std::string> suffixes;
  std::vector<std::string> include_prefixes;  // relative path must start with one (empty: any)
  std::vector<std::string> exclude_prefixes;
  std::vector<std::string> exclude_substrings;
  std::string format;  // "man": roff pages; "": by file name (ConvertDocumentFile)
  // Files are whole manuals, so max_document_bytes (against generated tables) does not apply to them.
  bool whole_manuals = false;
};

const std::vector<SourceDef>& SourceDefs() {
  static const auto* defs = new std::vector<SourceDef>{
      {{"kernel-docs", "prose", {"linux-source-6.1"}, "Linux kernel Documentation/ (reStructuredText)"},
       true,
       "",
       {".rst", ".txt"},
       {"Documentation/"},
       {},
       {},
       "",
       false},
      {{"kernel-code", "code", {"linux-source-6.1"}, "Linux kernel C sources and headers"},
       true,
       "",
       {".c", ".h"},
       {},
       {"Documentation/"},
       {"/asic_reg/"},  // asic_reg: generated registers
       "",
       false},
      {{"python-docs", "prose", {"python3.11-doc"}, "Python 3.11 documentation sources (reST)"},
       false,
       "/usr/share/doc/python3.11/html/_sources/",
       {".rst.txt"},
       {},
       {},
       {},
       "",
       false},
      {{"python-stdlib",
        "code",
        {"libpython3.11-minimal", "libpython3.11-stdlib"},
        "Python 3.11 standard library modules"},
       false,
       "/usr/lib/python3.11/",
       {".py"},
       {},
       {},
       {"site-packages/", "dist-packages/"},
       "",
       false},
      {{"perl-docs", "prose", {"perl-doc"}, "Perl 5 documentation (POD)"},
       false,
       "/usr/share/perl/",
       {".pod"},
       {},
       {},
       {},
       "",
       false},
      {{"git-docs", "prose", {"git-doc"}, "Git documentation (AsciiDoc)"},
       false,
       "/usr/share/doc/git-doc/",
       {".txt"},
       {},
       {},
       {},
       "",
       false},
      // The prose that Debian main's documentation packages carry, so that code need not dominate the
      // corpus (issue 26). HTML, info, man and .gz files are converted to text once (ConvertSource).
      {{"man-pages",
        "prose",
        {"manpages", "manpages-dev", "man-db", "groff-base"},  // man-db and groff render the pages
        "Linux man-pages: system calls, C library, files, overviews (roff, rendered by man-db)"},
       false,
       "/usr/share/man/",
       {".gz"},
       {"man"},  // man1/ ... man8/; translations live in <lang>/man*/
       {},
       {},
       "man",
       true},
      {{"info-manuals",
        "prose",
        {"autoconf-doc", "bash-doc", "binutils-doc", "coreutils", "diffutils", "findutils", "gettext",
         "gnu-standards", "gnuplot-doc", "grep", "guile-3.0-doc", "maxima-doc", "octave-doc", "r-doc-info",
         "sed", "zsh-doc"},
        "Texinfo manuals: Bash, Autoconf, binutils, coreutils, Guile, Octave, R, Zsh, ... (info)"},
       false,
       "/usr/share/info/",
       {".gz"},
       {},
       {},
       {},
       "",
       true},
      {{"vim-docs", "prose", {"vim-runtime"}, "Vim's help files (plain text)"},
       false,
       "/usr/share/vim/vim90/doc/",
       {".txt"},
       {},
       {},
       {},
       "",
       true},
      {{"postgres-docs", "prose", {"postgresql-doc-15"}, "PostgreSQL 15 manual (HTML)"},
       false,
       "/usr/share/doc/postgresql-doc-15/html/",
       {".html"},
       {},
       {},
       {},
       "",
       true},
      {{"sqlite-docs", "prose", {"sqlite3-doc"}, "SQLite documentation (HTML)"},
       false,
       "/usr/share/doc/sqlite3/",
       {".html"},
       {},
       {},
       {},
       "",
       true},
      {{"erlang-docs", "prose", {"erlang-doc"}, "Erlang/OTP user's guides and reference manuals (HTML)"},
       false,
       "/usr/share/doc/erlang-doc/",
       {".html"},
       {},
       {},
       {"/jinterface-", "/wx-"},  // javadoc of the Java binding; generated wxWidgets wrappers
       "",
       true},
      {{"rust-books",
        "prose",
        {"rust-doc"},
        "The Rust books: the Book, Reference, Rustonomicon, Rust by Example, ... (HTML)"},
       false,
       "/usr/share/doc/rust-doc/html/",
       {"/print.html"},  // mdBook's whole-book page; the chapter pages repeat the table of contents
       {},
       {},
       {},
       "",
       true},
      {{"nodejs-docs", "prose", {"nodejs-doc"}, "Node.js API documentation (Markdown)"},
       false,
       "/usr/share/doc/nodejs/api/",
       {".md.gz"},
       {},
       {},
       {},
       "",
       true},
      {{"llvm-docs",
        "prose",
        {"llvm-15-doc", "clang-15-doc", "cmake-doc"},
        "LLVM, Clang and CMake documentation sources (reST)"},
       false,
       "/usr/share/doc/",
       {".txt"},
       {"llvm-15-doc/html/_sources/", "clang-15/html/_sources/", "cmake-data/html/_sources/"},
       {},
       {},
       "",
       true},
      {{"python-lib-docs",
        "prose",
        {"python-django-doc", "python-sqlalchemy-doc"},
        "Django (HTML) and SQLAlchemy (reST) documentation"},
       false,
       "/usr/share/doc/",
       {".html", ".rst"},
       {"python-django-doc/html/", "python-sqlalchemy-doc/rst/"},
       {"python-django-doc/html/_modules/", "python-sqlalchemy-doc/rst/changelog/"},
       {"genindex", "py-modindex", "/search.html"},
       "",
       true},
      {{"debian-docs",
        "prose",
        {"debian-reference-en", "debian-policy", "developers-reference", "debian-faq", "debian-history",
         "debian-handbook", "harden-doc"},
        "Debian Reference, Policy, Developer's Reference, Administrator's Handbook, ... (English)"},
       false,
       "/usr/share/",
       {".txt.gz", ".html"},
       {"debian-reference/debian-reference.en.txt.gz", "doc/debian-policy/",
        "developers-reference/developers-reference.txt.gz", "doc/debian/FAQ/debian-faq.en.txt.gz",
        "doc/debian-history/docs/project-history.en.txt.gz", "doc/debian-handbook/html/en-US/",
        "doc/harden-doc/html/en-US/"},
       {"doc/debian-policy/policy.html/"},  // the HTML form of policy.txt.gz
       {},
       "",
       true},
      {{"libreoffice-help", "prose", {"libreoffice-help-en-us"}, "LibreOffice help (English, HTML)"},
       false,
       "/usr/share/libreoffice/help/en-US/",
       {".html"},
       {},
       {},
       {},
       "",
       true},
      {{"java-api-docs", "prose", {"openjdk-17-doc"}, "Java SE 17 API specification (Javadoc HTML)"},
       false,
       "/usr/share/doc/openjdk-17-jre-headless/api/",
       {".html"},
       {},
       {"index-files/"},
       {"/class-use/", "-tree.html", "package-use.html", "allclasses", "allpackages", "/search.html"},
       "",
       true},
  };
  return *defs;
}

bool AcceptPath(const SourceDef& def, const std::string& rel) {
  bool suffix_ok = false;
  for (const std::string& s : def.suffixes) suffix_ok |= absl::EndsWith(rel, s);
  if (!suffix_ok) return false;
  if (!def.include_prefixes.empty()) {
    bool ok = false;
    for (const std::string& p : def.include_prefixes) ok |= absl::StartsWith(rel, p);
    if (!ok) return false;
  }
  for (const std::string& p : def.exclude_prefixes) {
    if (absl::StartsWith(rel, p)) return false;
  }
  for (const std::string& s : def.exclude_substrings) {
    if (absl::StrContains(rel, s)) return false;
  }
  return true;
}

// --- packages ----------------------------------------------------------------------------------------

// The installed version of `package`, or NotFound.
absl::StatusOr<std::string> InstalledVersion(const std::string& package) {
  std::string out;
  CommandOptions o;
  o.captured_stdout = &out;
  o.quiet_stderr = true;
  absl::Status s = RunCommand({"dpkg-query", "-W", "-f=${Status}\t${Version}", package}, o);
  std::vector<std::string> parts = absl::StrSplit(out, '\t');
  if (!s.ok() || parts.size() != 2 || !absl::EndsWith(parts[0], " installed")) {
    return absl::NotFoundError(absl::StrCat("Debian package ", package, " is not installed"));
  }
  return parts[1];
}

// Installs the missing packages (root only) and returns every package's version.
absl::StatusOr<std::map<std::string, std::string>> EnsurePackages(const std::vector<std::string>& packages,
                                                                  bool install, bool progress) {
  std::vector<std::string> missing;
  for (const std::string& p : packages) {
    if (!InstalledVersion(p).ok()) missing.push_back(p);
  }
  if (!missing.empty()) {
    const std::string list = absl::StrJoin(missing, " ");
    if (!install || ::geteuid() != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("missing Debian package(s): ", list, "; install them with `apt-get install ", list,
                       "` (run as root to let oryx do it, or use --input-dir for your own text)"));
    }
    if (progress) std::cerr << "oryx data: installing " << list << " with apt-get\n";
    std::vector<std::string> argv = {"apt-get", "install", "-y", "--no-install-recommends"};
    argv.insert(argv.end(), missing.begin(), missing.end());
    CommandOptions o;
    o.stdout_to_stderr = true;
    o.extra_env = {"DEBIAN_FRONTEND=noninteractive"};
    if (!RunCommand(argv, o).ok()) {  // stale package lists are the usual cause: refresh once
      ORYX_RETURN_IF_ERROR(RunCommand({"apt-get", "update"}, o));
      absl::Status s = RunCommand(argv, o);
      if (!s.ok())
        return absl::FailedPreconditionError(absl::StrCat("cannot install ", list, ": ", s.message()));
    }
  }
  std::map<std::string, std::string> versions;
  for (const std::string& p : packages) {
    ORYX_ASSIGN_OR_RETURN(versions[p], InstalledVersion(p));
  }
  return versions;
}

absl::StatusOr<std::vector<std::string>> PackageFiles(const std::string& package) {
  std::string out;
  CommandOptions o;
  o.captured_stdout = &out;
  ORYX_RETURN_IF_ERROR(RunCommand({"dpkg-query", "-L", package}, o));
  return std::vector<std::string>(absl::StrSplit(out, '\n', absl::SkipEmpty()));
}

// --- converting documentation formats to text ----------------------------------------------------------

// Part of the cache key of converted files: bump it when a conversion changes its output.
constexpr int kConverterVersion = 1;

bool IsHtmlSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Appends the text of a character reference's name ("amp", "#8212", "#x2014"); false if unknown. Only
// the named references that documentation pages use are known; others stay as written.
bool AppendEntity(std::string_view name, std::string* out) {
  if (name.size() > 1 && name[0] == '#') {
    const bool hex = name[1] == 'x' || name[1] == 'X';
    std::string_view digits = name.substr(hex ? 2 : 1);
    if (digits.empty() || digits.size() > 8) return false;
    uint32_t cp = 0;
    for (char c : digits) {
      const unsigned char u = static_cast<unsigned char>(c);
      if (!(hex ? absl::ascii_isxdigit(u) : absl::ascii_isdigit(u))) return false;
      const int v = absl::ascii_isdigit(u) ? c - '0' : absl::ascii_tolower(u) - 'a' + 10;
      cp = cp * (hex ? 16 : 10) + static_cast<uint32_t>(v);
    }
    if (cp == 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
    if (cp == 0xA0) cp = ' ';
    if (cp != 0xAD && cp != 0x200B) AppendUtf8(cp, out);  // soft hyphen, zero-width space: nothing
    return true;
  }
  static const auto* kNamed = new std::map<std::string_view, uint32_t>{
      {"amp", '&'},       {"lt", '<'},         {"gt", '>'},         {"quot", '"'},        {"apos", '\''},
      {"nbsp", ' '},      {"ensp", ' '},       {"emsp", ' '},       {"thinsp", ' '},      {"ndash", 0x2013},
      {"mdash", 0x2014},  {"hellip", 0x2026},  {"lsquo", 0x2018},   {"rsquo", 0x2019},    {"sbquo", 0x201A},
      {"ldquo", 0x201C},  {"rdquo", 0x201D},   {"laquo", 0xAB},     {"raquo", 0xBB},      {"copy", 0xA9},
      {"reg", 0xAE},      {"trade", 0x2122},   {"times", 0xD7},     {"divide", 0xF7},     {"middot", 0xB7},
      {"bull", 0x2022},   {"para", 0xB6},      {"sect", 0xA7},      {"deg", 0xB0},        {"plusmn", 0xB1},
      {"micro", 0xB5},    {"larr", 0x2190},    {"rarr", 0x2192},    {"uarr", 0x2191},     {"darr", 0x2193},
      {"harr", 0x2194},   {"lArr", 0x21D0},    {"rArr", 0x21D2},    {"hArr", 0x21D4},     {"le", 0x2264},
      {"ge", 0x2265},     {"ne", 0x2260},      {"minus", 0x2212},   {"infin", 0x221E},    {"sum", 0x2211},
      {"prod", 0x220F},   {"radic", 0x221A},   {"asymp", 0x2248},   {"equiv", 0x2261},    {"isin", 0x2208},
      {"forall", 0x2200}, {"exist", 0x2203},   {"and", 0x2227},     {"or", 0x2228},       {"not", 0xAC},
      {"lceil", 0x2308},  {"rceil", 0x2309},   {"lfloor", 0x230A},  {"rfloor", 0x230B},   {"lang", 0x27E8},
      {"rang", 0x27E9},   {"alpha", 0x3B1},    {"beta", 0x3B2},     {"gamma", 0x3B3},     {"delta", 0x3B4},
      {"epsilon", 0x3B5}, {"lambda", 0x3BB},   {"mu", 0x3BC},       {"pi", 0x3C0},        {"sigma", 0x3C3},
      {"tau", 0x3C4},     {"phi", 0x3C6},      {"omega", 0x3C9},    {"dagger", 0x2020},   {"Dagger", 0x2021},
      {"prime", 0x2032},  {"euro", 0x20AC},    {"pound", 0xA3},     {"yen", 0xA5},        {"cent", 0xA2},
      {"iexcl", 0xA1},    {"iquest", 0xBF},    {"acute", 0xB4},     {"uml", 0xA8},        {"ordf", 0xAA},
      {"ordm", 0xBA},     {"sup1", 0xB9},      {"sup2", 0xB2},      {"sup3", 0xB3},       {"frac12", 0xBD},
      {"frac14", 0xBC},   {"frac34", 0xBE},    {"aacute", 0xE1},    {"agrave", 0xE0},     {"acirc", 0xE2},
      {"auml", 0xE4},     {"atilde", 0xE3},    {"aring", 0xE5},     {"aelig", 0xE6},      {"ccedil", 0xE7},
      {"eacute", 0xE9},   {"egrave", 0xE8},    {"ecirc", 0xEA},     {"euml", 0xEB},       {"iacute", 0xED},
      {"igrave", 0xEC},   {"icirc", 0xEE},     {"iuml", 0xEF},      {"ntilde", 0xF1},     {"oacute", 0xF3},
      {"ograve", 0xF2},   {"ocirc", 0xF4},     {"ouml", 0xF6},      {"otilde", 0xF5},     {"oslash", 0xF8},
      {"uacute", 0xFA},   {"ugrave", 0xF9},    {"ucirc", 0xFB},     {"uuml", 0xFC},       {"yacute", 0xFD},
      {"yuml", 0xFF},     {"szlig", 0xDF},     {"Aacute", 0xC1},    {"Agrave", 0xC0},     {"Auml", 0xC4},
      {"Aring", 0xC5},    {"Ccedil", 0xC7},    {"Eacute", 0xC9},    {"Egrave", 0xC8},     {"Ntilde", 0xD1},
      {"Oacute", 0xD3},   {"Ouml", 0xD6},      {"Oslash", 0xD8},    {"Uacute", 0xDA},     {"Uuml", 0xDC},
  };
  if (name == "shy" || name == "zwj" || name == "zwnj" || name == "lrm" || name == "rlm") return true;
  const auto it = kNamed->find(name);
  if (it == kNamed->end()) return false;
  AppendUtf8(it->second, out);
  return true;
}

std::string DecodeEntities(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t amp = s.find('&', i);
    if (amp == std::string_view::npos) {
      out.append(s.substr(i));
      break;
    }
    out.append(s.substr(i, amp - i));
    const size_t semi = s.find(';', amp + 1);
    if (semi != std::string_view::npos && semi - amp <= 12 && AppendEntity(s.substr(amp + 1, semi - amp - 1), &out)) {
      i = semi + 1;
    } else {
      out.push_back('&');
      i = amp + 1;
    }
  }
  return out;
}

// Trailing blanks removed from every line, runs of blank lines cut to one, none at the start or end;
// ends with one newline unless empty.
std::string TidyLines(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  int blank_run = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    size_t end = line.size();
    while (end > 0 && (line[end - 1] == ' ' || line[end - 1] == '\t' || line[end - 1] == '\r')) --end;
    line = line.substr(0, end);
    if (line.empty()) {
      ++blank_run;
      continue;
    }
    if (!out.empty() && blank_run > 0) out.push_back('\n');
    blank_run = 0;
    out.append(line.data(), line.size());
    out.push_back('\n');
  }
  return out;
}

// Builds the text of a page: collapses white space outside <pre>, and places line breaks.
class HtmlTextWriter {
 public:
  void Text(std::string_view s, bool pre) {
    if (pre) {
      for (char c : s) {
        if (c != '\r') out_.push_back(c);
      }
      space_ = false;
      marker_ = marker_ && s.empty();
      return;
    }
    for (char c : s) {
      if (IsHtmlSpace(c)) {
        space_ = true;
        continue;
      }
      if (space_ && !out_.empty() && out_.back() != '\n' && out_.back() != ' ') out_.push_back(' ');
      space_ = false;
      marker_ = false;
      out_.push_back(c);
    }
  }
  // Text written as is, without collapsing (cell separators).
  void Raw(std::string_view s) {
    out_.append(s);
    space_ = false;
  }
  // A list item's marker or a definition's indent: a paragraph that opens right after it stays on its line.
  void Marker(std::string_view s) {
    if (marker_) {  // an item that opens with a nested list
      marker_ = false;
      Break(1);
    }
    Raw(s);
    marker_ = true;
  }
  // Ends the line, and with `lines` = 2 leaves a blank line; nothing at the start of the page.
  void Break(int lines) {
    if (marker_) return;
    space_ = false;
    while (!out_.empty() && out_.back() == ' ') out_.pop_back();
    if (out_.empty()) return;
    int have = 0;
    for (size_t k = out_.size(); k > 0 && out_[k - 1] == '\n' && have < lines; --k) ++have;
    for (; have < lines; ++have) out_.push_back('\n');
  }
  std::string Finish() { return TidyLines(out_); }

 private:
  std::string out_;
  bool space_ = false;
  bool marker_ = false;
};

struct HtmlTag {
  std::string name;  // lower case
  bool closing = false;
  bool self_closing = false;
  std::string cls, id, role;  // attribute values, lower case
};

// Parses the tag at html[pos] == '<'; returns the position after its '>', or npos if it is no tag.
size_t ParseHtmlTag(std::string_view html, size_t pos, HtmlTag* tag) {
  size_t i = pos + 1;
  tag->closing = i < html.size() && html[i] == '/';
  if (tag->closing) ++i;
  if (i >= html.size() || !absl::ascii_isalpha(static_cast<unsigned char>(html[i]))) return std::string_view::npos;
  tag->name.clear();
  while (i < html.size() && (absl::ascii_isalnum(static_cast<unsigned char>(html[i])) || html[i] == '-' ||
                             html[i] == ':' || html[i] == '_')) {
    tag->name.push_back(absl::ascii_tolower(static_cast<unsigned char>(html[i++])));
  }
  tag->self_closing = false;
  tag->cls.clear();
  tag->id.clear();
  tag->role.clear();
  while (i < html.size()) {
    while (i < html.size() && IsHtmlSpace(html[i])) ++i;
    if (i >= html.size()) break;
    if (html[i] == '>') return i + 1;
    if (html[i] == '/') {
      tag->self_closing = true;
      ++i;
      continue;
    }
    std::string attr;
    while (i < html.size() && !IsHtmlSpace(html[i]) && html[i] != '=' && html[i] != '>' && html[i] != '/') {
      attr.push_back(absl::ascii_tolower(static_cast<unsigned char>(html[i++])));
    }
    if (attr.empty()) {  // a stray character such as a quote
      ++i;
      continue;
    }
    while (i < html.size() && IsHtmlSpace(html[i])) ++i;
    std::string value;
    if (i < html.size() && html[i] == '=') {
      ++i;
      while (i < html.size() && IsHtmlSpace(html[i])) ++i;
      if (i < html.size() && (html[i] == '"' || html[i] == '\'')) {
        const size_t close = html.find(html[i], i + 1);
        if (close == std::string_view::npos) return std::string_view::npos;
        value = std::string(html.substr(i + 1, close - i - 1));
        i = close + 1;
      } else {
        while (i < html.size() && !IsHtmlSpace(html[i]) && html[i] != '>') value.push_back(html[i++]);
      }
    }
    absl::AsciiStrToLower(&value);
    if (attr == "class") tag->cls = value;
    if (attr == "id") tag->id = value;
    if (attr == "role") tag->role = value;
  }
  return std::string_view::npos;
}

bool IsVoidElement(std::string_view name) {
  static const auto* kVoid = new std::set<std::string_view>{"area", "base", "br", "col", "embed", "hr", "img",
                                                            "input", "link", "meta", "param", "source", "track",
                                                            "wbr"};
  return kVoid->count(name) > 0;
}

// Elements whose content is no part of the text: the head, scripts and styles, and the navigation that
// documentation generators (Sphinx, DocBook, mdBook, Javadoc, Publican) put around every page.
bool SkipsContent(const HtmlTag& t) {
  static const auto* kNames = new std::set<std::string_view>{
      "head", "script", "style", "noscript", "nav", "svg", "form", "button", "select", "template", "iframe",
      "object", "canvas"};
  static const auto* kClasses = new std::set<std::string_view>{
      "navheader", "navfooter", "sphinxsidebar", "sidebar", "headerlink", "menu-bar", "breadcrumbs",
      "skip-nav", "sub-nav", "top-nav", "flex-header", "related", "nav", "menu", "searchmenu", "topbar", "docnav"};
  if (kNames->count(t.name) > 0) return true;
  if (t.role == "navigation" || t.role == "search" || t.role == "banner") return true;
  for (absl::string_view c : absl::StrSplit(t.cls, ' ', absl::SkipEmpty())) {
    if (kClasses->count(std::string_view(c.data(), c.size())) > 0) return true;
  }
  return t.id == "sidebar" || t.id == "searchbox";
}

// Where `needle` (lower case, starting with '<') first occurs in html from pos, ignoring case.
size_t FindNoCase(std::string_view html, std::string_view needle, size_t pos) {
  for (size_t i = html.find('<', pos); i != std::string_view::npos; i = html.find('<', i + 1)) {
    if (i + needle.size() > html.size()) return std::string_view::npos;
    bool match = true;
    for (size_t k = 0; k < needle.size() && match; ++k)
      match = absl::ascii_tolower(static_cast<unsigned char>(html[i + k])) == needle[k];
    if (match) return i;
  }
  return std::string_view::npos;
}

// The position after the element opened just before `pos` (its end tag, counting nested ones of the same
// name), or npos when it is never closed. Text elements (script, style) end at the first end tag.
size_t SkipElement(std::string_view html, size_t pos, const std::string& name) {
  if (name == "script" || name == "style") {
    const size_t end = FindNoCase(html, "</" + name, pos);
    if (end == std::string_view::npos) return end;
    const size_t gt = html.find('>', end);
    return gt == std::string_view::npos ? html.size() : gt + 1;
  }
  int depth = 1;
  HtmlTag t;
  for (size_t i = html.find('<', pos); i != std::string_view::npos; i = html.find('<', i)) {
    if (html.compare(i, 4, "<!--") == 0) {
      const size_t e = html.find("-->", i + 4);
      if (e == std::string_view::npos) return e;
      i = e + 3;
      continue;
    }
    const size_t next = ParseHtmlTag(html, i, &t);
    if (next == std::string_view::npos) {
      ++i;
      continue;
    }
    if (name == "head" && !t.closing && t.name == "body") return i;  // </head> is optional
    if (t.name == name && !t.self_closing) depth += t.closing ? -1 : 1;
    if (depth == 0) return next;
    if (!t.closing && (t.name == "script" || t.name == "style")) {
      const size_t e = SkipElement(html, next, t.name);
      if (e == std::string_view::npos) return e;
      i = e;
      continue;
    }
    i = next;
  }
  return std::string_view::npos;
}

// Texinfo's output names: NAME.info, or NAME.info-N for the parts of a split manual.
bool IsInfoName(std::string_view name) {
  const size_t info = name.rfind(".info");
  if (info == std::string_view::npos) return false;
  const std::string_view rest = name.substr(info + 5);
  return rest.empty() || (rest.size() > 1 && rest[0] == '-' &&
                          std::all_of(rest.begin() + 1, rest.end(), [](char c) { return c >= '0' && c <= '9'; }));
}

}  // namespace

std::string HtmlToText(std::string_view html) {
  static const auto* kParagraphs = new std::set<std::string_view>{
      "p",      "blockquote", "table",   "ul", "ol", "dl", "section", "article", "header", "footer", "figure",
      "address", "details", "fieldset", "hr", "h1", "h2", "h3",      "h4",      "h5",     "h6",     "pre"};
  static const auto* kLines = new std::set<std::string_view>{
      "br", "div", "li", "tr", "dt", "dd", "caption", "main", "aside", "summary", "figcaption", "option", "center",
      "tbody", "thead", "tfoot", "body", "html", "title"};
  HtmlTextWriter w;
  struct List {
    bool ordered = false;
    int items = 0;
  };
  std::vector<List> lists;
  int pre = 0;
  int heading = 0;            // inside <h1>..<h6>, whose text stays on one line whatever blocks it holds
  bool skip_newline = false;  // the newline right after <pre> is no part of its text
  bool row_has_cell = false;
  HtmlTag t;
  size_t i = 0;
  while (i < html.size()) {
    if (html[i] != '<') {
      size_t end = html.find('<', i);
      if (end == std::string_view::npos) end = html.size();
      std::string text = DecodeEntities(html.substr(i, end - i));
      if (skip_newline && !text.empty() && text[0] == '\n') text.erase(0, 1);
      skip_newline = false;
      w.Text(text, pre > 0);
      i = end;
      continue;
    }
    if (html.compare(i, 4, "<!--") == 0) {
      const size_t e = html.find("-->", i + 4);
      i = e == std::string_view::npos ? html.size() : e + 3;
      continue;
    }
    if (html.compare(i, 9, "<![CDATA[") == 0) {
      size_t e = html.find("]]>", i + 9);
      if (e == std::string_view::npos) e = html.size();
      w.Text(html.substr(i + 9, e - i - 9), pre > 0);
      i = std::min(e + 3, html.size());
      continue;
    }
    if (i + 1 < html.size() && (html[i + 1] == '!' || html[i + 1] == '?')) {  // doctype, processing instruction
      const size_t e = html.find('>', i);
      i = e == std::string_view::npos ? html.size() : e + 1;
      continue;
    }
    const size_t next = ParseHtmlTag(html, i, &t);
    if (next == std::string_view::npos) {  // a '<' in text
      w.Text("<", pre > 0);
      ++i;
      continue;
    }
    i = next;
    skip_newline = false;
    const std::string& n = t.name;
    if (!t.closing && !t.self_closing && !IsVoidElement(n) && SkipsContent(t)) {
      const size_t end = SkipElement(html, i, n);
      if (end != std::string_view::npos) {
        i = end;
        continue;
      }
    }
    const bool is_heading = n.size() == 2 && n[0] == 'h' && n[1] >= '1' && n[1] <= '6';
    if (heading > 0 && !is_heading) {  // inline inside a heading: just a space between block-level parts
      if (kParagraphs->count(n) > 0 || kLines->count(n) > 0) w.Text(" ", false);
      continue;
    }
    if (t.closing) {
      if (n == "pre" && pre > 0) --pre;
      if (is_heading && heading > 0) --heading;
      if ((n == "ul" || n == "ol") && !lists.empty()) lists.pop_back();
      if (kParagraphs->count(n) > 0) {
        w.Break(2);
      } else if (kLines->count(n) > 0) {
        w.Break(1);
      }
      continue;
    }
    if (n == "br") {
      if (pre > 0) {
        w.Raw("\n");
      } else {
        w.Break(1);
      }
      continue;
    }
    if (kParagraphs->count(n) > 0) {
      w.Break(2);
    } else if (kLines->count(n) > 0) {
      w.Break(1);
    }
    if (is_heading) {
      ++heading;
      w.Raw(std::string(n[1] - '0', '#') + " ");
    } else if (n == "pre") {
      ++pre;
      skip_newline = true;
    } else if (n == "ul" || n == "ol") {
      lists.push_back({n == "ol", 0});
    } else if (n == "li") {
      const std::string indent(2 * (lists.empty() ? 0 : lists.size() - 1), ' ');
      if (!lists.empty() && lists.back().ordered) {
        w.Marker(absl::StrCat(indent, ++lists.back().items, ". "));
      } else {
        w.Marker(indent + "- ");
      }
    } else if (n == "dd") {
      w.Marker("    ");
    } else if (n == "tr") {
      row_has_cell = false;
    } else if (n == "td" || n == "th") {
      if (row_has_cell) w.Raw(" | ");
      row_has_cell = true;
    }
  }
  return w.Finish();
}

std::string InfoToText(std::string_view info) {
  // Texinfo's index and image markers: "\0\b[index\0\b]" and the like, around node names.
  std::string clean;
  clean.reserve(info.size());
  for (size_t i = 0; i < info.size(); ++i) {
    if (info[i] == '\0' && i + 2 < info.size() && info[i + 1] == '\b' && info[i + 2] == '[') {
      const size_t end = info.find(std::string_view("\0\b]", 3), i + 3);
      if (end != std::string_view::npos) {
        i = end + 2;
        continue;
      }
    }
    if (info[i] != '\0' && info[i] != '\b') clean.push_back(info[i]);
  }
  const std::vector<absl::string_view> nodes = absl::StrSplit(clean, '\x1f');
  if (nodes.size() == 1) return TidyLines(clean);  // not an info file after all
  std::string out;
  // nodes[0] is the preamble: makeinfo's banner, the copying permissions and the directory entry.
  for (size_t k = 1; k < nodes.size(); ++k) {
    absl::string_view node = nodes[k];
    while (!node.empty() && (node[0] == '\n' || node[0] == '\f')) node.remove_prefix(1);
    if (absl::StartsWith(node, "File:")) {
      const size_t eol = node.find('\n');
      const absl::string_view text = node.substr(eol == absl::string_view::npos ? node.size() : eol + 1);
      out.append(text.data(), text.size());
      out.append("\n\n");
    } else if (!absl::StartsWith(node, "Tag Table:") && !absl::StartsWith(node, "Indirect:") &&
               !absl::StartsWith(node, "End Tag Table") && !absl::StartsWith(node, "Local Variables:")) {
      out.append(node.data(), node.size());
      out.append("\n\n");
    }
  }
  return TidyLines(out);
}

absl::StatusOr<std::string> ConvertDocumentFile(const std::string& path, const std::string& format) {
  std::string name = path;
  std::string data;
  if (absl::EndsWith(path, ".gz")) {
    CommandOptions o;
    o.captured_stdout = &data;
    o.quiet_stderr = true;
    ORYX_RETURN_IF_ERROR(RunCommand({"gzip", "-dc", "--", path}, o));
    name.resize(name.size() - 3);
  } else {
    ORYX_ASSIGN_OR_RETURN(data, ReadFile(path));
  }
  if (format == "man") {
    // A page that only sources another (".so man3/x.3") would repeat that page.
    for (absl::string_view line : absl::StrSplit(data, '\n', absl::SkipWhitespace())) {
      if (absl::StartsWith(line, ".\\\"") || absl::StartsWith(line, "'\\\"")) continue;
      if (absl::StartsWith(line, ".so ")) return std::string();
      break;
    }
    // Plain UTF-8 text 80 columns wide, left-adjusted and unhyphenated, so that words stay whole; the
    // user's man settings (MANOPT, MAN_KEEP_FORMATTING: overstrike) must not change the corpus.
    std::string text;
    CommandOptions o;
    o.captured_stdout = &text;
    o.quiet_stderr = true;
    o.extra_env = {"LC_ALL=C.UTF-8", "MANWIDTH=80", "MAN_KEEP_FORMATTING=", "MANOPT=", "MANROFFOPT=",
                   "MANPAGER=cat", "PAGER=cat", "MAN_DISABLE_SECCOMP=1"};
    ORYX_RETURN_IF_ERROR(RunCommand({"man", "--local-file", "--no-justification", "--no-hyphenation",
                                     "--encoding=UTF-8", path},
                                    o));
    return TidyLines(text);
  }
  if (!format.empty()) return absl::InvalidArgumentError(absl::StrCat("unknown document format '", format, "'"));
  if (absl::EndsWith(name, ".html") || absl::EndsWith(name, ".htm")) return HtmlToText(data);
  if (IsInfoName(name)) return InfoToText(data);
  return data;
}

namespace {

// --- listing documents -------------------------------------------------------------------------------

// One file of a document.
struct Part {
  std::string rel;   // relative path in its source
  std::string path;  // on disk (for converted files, the text in the work directory)
  int64_t bytes = 0;
};

// A file, or with min_document_bytes a run of consecutive files of one source.
struct Document {
  int source = 0;
  std::string id;  // "<source>/<relative path of the first part>": what the split and the order are hashed from
  std::vector<Part> parts;
  int64_t bytes = 0;  // of all parts
  bool val = false;
  uint64_t order = 0;
};

struct SourceStats {
  int64_t listed_documents = 0;
  int64_t listed_bytes = 0;
  std::map<std::string, int64_t> skipped;  // reason -> files
  int64_t documents[2] = {0, 0};           // [train, val]
  int64_t tokens[2] = {0, 0};
  int64_t text_bytes = 0;
};

struct Source {
  std::string name;
  std::string kind;
  std::map<std::string, std::string> packages;  // name -> version
  std::vector<Part> files;  // the usable files, in path order
  std::vector<Document> documents;
  SourceStats stats;
};

uint64_t Load64(const std::array<uint8_t, 32>& d, int offset) {
  uint64_t x = 0;
  for (int i = 0; i < 8; ++i) x = (x << 8) | d[offset + i];
  return x;
}

// Adds a regular file to source `s` (too-large and empty files are only counted).
void AddFile(Source* s, const std::string& rel, const std::string& path, int64_t max_bytes) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  s->stats.listed_documents++;
  s->stats.listed_bytes += st.st_size;
  if (st.st_size > max_bytes) {
    s->stats.skipped["too_large"]++;
    return;
  }
  if (st.st_size == 0) {
    s->stats.skipped["empty"]++;
    return;
  }
  s->files.push_back({rel, path, st.st_size});
}

// Turns a source's files into documents: one per file, or with min_bytes > 0 runs of consecutive files
// (path order keeps a manual's chapters, a directory's files together) of at least min_bytes, a short
// last run joining the one before, so that documents fill long training windows.
void MakeDocuments(Source* s, int source_index, int64_t min_bytes, double val_fraction) {
  std::vector<std::vector<Part>> runs;
  int64_t run_bytes = 0;
  for (Part& f : s->files) {
    if (min_bytes <= 0 || runs.empty() || run_bytes >= min_bytes) {
      runs.emplace_back();
      run_bytes = 0;
    }
    run_bytes += f.bytes;
    runs.back().push_back(std::move(f));
  }
  if (min_bytes > 0 && runs.size() > 1 && run_bytes < min_bytes) {
    std::vector<Part> last = std::move(runs.back());
    runs.pop_back();
    for (Part& f : last) runs.back().push_back(std::move(f));
  }
  s->files.clear();
  for (std::vector<Part>& run : runs) {
    Document d;
    d.source = source_index;
    d.id = s->name + "/" + run[0].rel;
    for (const Part& f : run) d.bytes += f.bytes;
    d.parts = std::move(run);
    Sha256 h;
    h.Update(d.id);
    const std::array<uint8_t, 32> digest = h.Digest();
    // The first 8 bytes decide the split, the next 8 the order: independent, and stable when other
    // documents are added or removed.
    d.val = static_cast<double>(Load64(digest, 0) >> 11) * 0x1.0p-53 < val_fraction;
    d.order = Load64(digest, 8);
    s->documents.push_back(std::move(d));
  }
}

// Every regular file under `root` (recursively, hidden names skipped), relative paths sorted.
absl::StatusOr<std::vector<std::string>> WalkDirectory(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return absl::NotFoundError(absl::StrCat(root, ": not a directory"));
  std::vector<std::string> rels;
  fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
  if (ec) return absl::NotFoundError(absl::StrCat(root, ": cannot read directory: ", ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) return absl::InternalError(absl::StrCat(root, ": cannot walk: ", ec.message()));
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file() && !it->is_symlink()) {
      rels.push_back(fs::relative(it->path(), root).string());
    }
  }
  std::sort(rels.begin(), rels.end());
  return rels;
}

// Unpacks the source tarball shipped by `package` into the work directory once (a marker file records
// the package version), and returns the tree's root.
absl::StatusOr<std::string> UnpackTarball(const std::string& package, const std::string& version,
                                          const std::string& work_dir, bool progress) {
  ORYX_ASSIGN_OR_RETURN(std::vector<std::string> files, PackageFiles(package));
  std::string tarball;
  for (const std::string& f : files) {
    if (absl::EndsWith(f, ".tar.xz") || absl::EndsWith(f, ".tar.gz") || absl::EndsWith(f, ".tar.bz2"))
      tarball = f;
  }
  if (tarball.empty())
    return absl::NotFoundError(absl::StrCat("package ", package, " ships no source tarball"));
  const std::string dest = absl::StrCat(work_dir, "/", package, "_", version);
  const std::string marker = dest + "/.oryx-unpacked";
  std::string top = fs::path(tarball).filename().string();
  top = top.substr(0, top.find(".tar"));
  if (fs::exists(marker)) return dest + "/" + top;
  if (progress) std::cerr << "oryx data: unpacking " << tarball << " into " << dest << "\n";
  const std::string tmp = dest + ".partial";
  std::error_code ec;
  (void)RemoveTree(tmp);
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", ec.message()));
  // Only what the kernel sources read: Documentation/ and C files (a third of the tarball).
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-xf", tarball, "-C", tmp, "--wildcards", "--no-same-owner",
                                   top + "/Documentation/*", "*.c", "*.h"}));
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(tmp + "/.oryx-unpacked", version));
  (void)RemoveTree(dest);
  fs::rename(tmp, dest, ec);
  if (ec) return absl::InternalError(absl::StrCat(dest, ": cannot rename: ", ec.message()));
  return dest + "/" + top;
}

bool NeedsConversion(const SourceDef& def, const std::string& rel) {
  return !def.format.empty() || absl::EndsWith(rel, ".gz") || absl::EndsWith(rel, ".html") ||
         absl::EndsWith(rel, ".htm") || IsInfoName(rel);
}

// Converts the files of a source that are not plain text (compressed, HTML, info, man pages) to text in
// the work directory, in parallel, once: the directory's name hashes the converter version, the packages'
// versions and the file list, and a marker written last lists the files whose conversion failed. Returns
// each file's text path, "" where the conversion failed; plain files are read where they are.
absl::StatusOr<std::vector<std::string>> ConvertSource(
    const SourceDef& def, const Source& s, const std::vector<std::pair<std::string, std::string>>& files,
    const std::string& work_dir, int threads, bool progress) {
  std::vector<std::string> out(files.size());
  std::vector<size_t> jobs;
  Sha256 key;
  key.Update(absl::StrCat("converter ", kConverterVersion, " format ", def.format, "\n"));
  for (const auto& [name, version] : s.packages) key.Update(absl::StrCat(name, " ", version, "\n"));
  for (size_t k = 0; k < files.size(); ++k) {
    if (NeedsConversion(def, files[k].first)) {
      jobs.push_back(k);
      key.Update(files[k].first + "\n");
    } else {
      out[k] = files[k].second;
    }
  }
  if (jobs.empty()) return out;
  const std::string dir = absl::StrCat(work_dir, "/", s.name, "_", key.HexDigest().substr(0, 16));
  const std::string marker = dir + "/.oryx-converted";
  std::error_code ec;
  json done = json::parse(ReadFile(marker).value_or(""), nullptr, /*allow_exceptions=*/false);
  if (!done.is_object() || !done.contains("failed")) {
    const std::string tmp = dir + ".partial";
    (void)RemoveTree(tmp);
    for (size_t k : jobs) {
      fs::create_directories(fs::path(absl::StrCat(tmp, "/", files[k].first)).parent_path(), ec);
      if (ec) return absl::InternalError(absl::StrCat(tmp, ": cannot create directories: ", ec.message()));
    }
    if (progress) {
      std::cerr << absl::StrFormat("oryx data: converting %d files of %s to text in %s\n", jobs.size(), s.name,
                                   dir);
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::string> errors(jobs.size());  // a failed conversion leaves that file out
    std::vector<absl::Status> written(jobs.size());
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t j = next++; j < jobs.size(); j = next++) {
        const auto& [rel, path] = files[jobs[j]];
        absl::StatusOr<std::string> text = ConvertDocumentFile(path, def.format);
        if (!text.ok()) {
          errors[j] = std::string(text.status().message());
          continue;
        }
        written[j] = WriteFileAtomic(absl::StrCat(tmp, "/", rel, ".txt"), *text);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& th : pool) th.join();
    json failed = json::array();
    for (size_t j = 0; j < jobs.size(); ++j) {
      ORYX_RETURN_IF_ERROR(written[j]);
      if (!errors[j].empty()) failed.push_back(files[jobs[j]].first);
    }
    if (failed.size() == jobs.size()) {  // the converter itself is broken, not one file
      return absl::FailedPreconditionError(
          absl::StrCat("source ", s.name, ": no file could be converted to text; the first: ", errors[0]));
    }
    done = {{"converter_version", kConverterVersion}, {"files", jobs.size()}, {"failed", failed}};
    ORYX_RETURN_IF_ERROR(WriteFileAtomic(tmp + "/.oryx-converted", JsonText(done, 2) + "\n"));
    (void)RemoveTree(dir);
    fs::rename(tmp, dir, ec);
    if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot rename: ", ec.message()));
    if (progress) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cerr << absl::StrFormat("oryx data: converted %d files of %s in %.1f s (%d failed%s%s)\n", jobs.size(),
                                   s.name, secs, failed.size(), failed.empty() ? "" : ", e.g. ",
                                   failed.empty() ? "" : failed[0].get<std::string>());
    }
  }
  std::set<std::string> failed;
  for (const json& f : done["failed"]) failed.insert(f.get<std::string>());
  for (size_t k : jobs) out[k] = failed.count(files[k].first) > 0 ? "" : absl::StrCat(dir, "/", files[k].first, ".txt");
  return out;
}

absl::Status ListPackageSource(const SourceDef& def, const PrepareCorpusOptions& o, const std::string& work_dir,
                               Source* s) {
  std::vector<std::pair<std::string, std::string>> files;  // relative path, path
  if (def.from_tarball) {
    const std::string& pkg = def.info.packages[0];
    ORYX_ASSIGN_OR_RETURN(std::string root, UnpackTarball(pkg, s->packages.at(pkg), work_dir, o.progress));
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> rels, WalkDirectory(root));
    for (const std::string& rel : rels) {
      if (AcceptPath(def, rel)) files.emplace_back(rel, root + "/" + rel);
    }
  } else {
    std::vector<std::string> paths;
    for (const std::string& pkg : def.info.packages) {
      ORYX_ASSIGN_OR_RETURN(std::vector<std::string> listed, PackageFiles(pkg));
      paths.insert(paths.end(), listed.begin(), listed.end());
    }
    std::sort(paths.begin(), paths.end());
    paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
    for (const std::string& path : paths) {
      if (!absl::StartsWith(path, def.root)) continue;
      const std::string rel = path.substr(def.root.size());
      struct stat st;
      if (AcceptPath(def, rel) && ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode))
        files.emplace_back(rel, path);
    }
  }
  ORYX_ASSIGN_OR_RETURN(std::vector<std::string> text_paths,
                        ConvertSource(def, *s, files, work_dir, o.threads, o.progress));
  for (size_t k = 0; k < files.size(); ++k) {
    if (text_paths[k].empty()) {
      s->stats.listed_documents++;
      s->stats.skipped["conversion_failed"]++;
    } else {
      AddFile(s, files[k].first, text_paths[k],
              def.whole_manuals ? std::numeric_limits<int64_t>::max() : o.max_document_bytes);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Source>> ListSources(const PrepareCorpusOptions& o, const std::string& work_dir) {
  std::vector<Source> sources;
  if (!o.input_dir.empty() || !o.input_code_dir.empty()) {
    for (const auto& [dir, name, kind] : {std::tuple(o.input_dir, "input", "text"),
                                          std::tuple(o.input_code_dir, "input-code", "code")}) {
      if (dir.empty()) continue;
      Source s;
      s.name = name;
      s.kind = kind;
      ORYX_ASSIGN_OR_RETURN(std::vector<std::string> rels, WalkDirectory(dir));
      for (const std::string& rel : rels) AddFile(&s, rel, dir + "/" + rel, o.max_document_bytes);
      MakeDocuments(&s, static_cast<int>(sources.size()), o.min_document_bytes, o.val_fraction);
      sources.push_back(std::move(s));
    }
    return sources;
  }
  std::vector<const SourceDef*> chosen;
  for (const SourceDef& def : SourceDefs()) {
    if (o.sources.empty() ||
        std::find(o.sources.begin(), o.sources.end(), def.info.name) != o.sources.end()) {
      chosen.push_back(&def);
    }
  }
  std::vector<std::string> packages;
  for (const SourceDef* def : chosen)
    packages.insert(packages.end(), def->info.packages.begin(), def->info.packages.end());
  std::sort(packages.begin(), packages.end());
  packages.erase(std::unique(packages.begin(), packages.end()), packages.end());
  ORYX_ASSIGN_OR_RETURN(auto versions, EnsurePackages(packages, o.install_packages, o.progress));
  for (const SourceDef* def : chosen) {
    Source s;
    s.name = def->info.name;
    s.kind = def->info.kind;
    for (const std::string& p : def->info.packages) s.packages[p] = versions.at(p);
    ORYX_RETURN_IF_ERROR(ListPackageSource(*def, o, work_dir, &s));
    const int64_t files = static_cast<int64_t>(s.files.size());
    MakeDocuments(&s, static_cast<int>(sources.size()), o.min_document_bytes, o.val_fraction);
    if (o.progress) {
      std::cerr << absl::StrFormat("oryx data: %-16s %7d files, %7d documents, %8.1f MB\n", s.name, files,
                                   s.documents.size(), s.stats.listed_bytes / 1e6);
    }
    sources.push_back(std::move(s));
  }
  return sources;
}

// --- reading documents -------------------------------------------------------------------------------

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, int64_t expected) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string data(static_cast<size_t>(expected), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = ::read(fd, data.data() + got, data.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got != data.size()) return absl::DataLossError(absl::StrCat(path, ": changed size while reading"));
  return data;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const auto trail = [&](size_t k) { return k < s.size() && (b(k) & 0xC0) == 0x80; };
  while (i < s.size()) {
    const uint8_t c = b(i);
    if (c < 0x80) {
      ++i;
    } else if (c >= 0xC2 && c <= 0xDF && trail(i + 1)) {
      i += 2;
    } else if (c >= 0xE0 && c <= 0xEF && trail(i + 1) && trail(i + 2) && !(c == 0xE0 && b(i + 1) < 0xA0) &&
               !(c == 0xED && b(i + 1) >= 0xA0)) {
      i += 3;
    } else if (c >= 0xF0 && c <= 0xF4 && trail(i + 1) && trail(i + 2) && trail(i + 3) &&
               !(c == 0xF0 && b(i + 1) < 0x90) && !(c == 0xF4 && b(i + 1) >= 0x90)) {
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

// Why a document is left out, or "" to keep it. Text is never altered: only whole files are dropped.
std::string SkipReason(std::string_view text, bool is_code) {
  if (text.find('\0') != std::string_view::npos) return "binary";
  if (!IsValidUtf8(text)) return "invalid_utf8";
  if (!is_code) return "";
  std::string head(text.substr(0, 2048));
  absl::AsciiStrToLower(&head);
  for (const char* marker : {"do not edit", "automatically generated", "autogenerated", "auto-generated"}) {
    if (absl::StrContains(head, marker)) return "generated";
  }
  int64_t hex_literals = 0;
  for (size_t p = text.find("0x"); p != std::string_view::npos; p = text.find("0x", p + 2)) ++hex_literals;
  if (hex_literals * 24 > static_cast<int64_t>(text.size())) return "data_table";
  return "";
}

// The texts of a document's parts.
absl::StatusOr<std::vector<std::string>> ReadParts(const Document& d) {
  std::vector<std::string> texts;
  texts.reserve(d.parts.size());
  for (const Part& p : d.parts) {
    ORYX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(p.path, p.bytes));
    texts.push_back(std::move(text));
  }
  return texts;
}

// The title line before each part of a document made of several files (min_document_bytes): the file's path
// in its source, without a .gz suffix, as `head` titles the files it prints.
std::string PartTitle(const Part& p) {
  return absl::StrCat("==> ", absl::StripSuffix(p.rel, ".gz"), " <==\n\n");
}

// --- tokenizer ---------------------------------------------------------------------------------------

// Training lines for the tokenizer from the train split. Each kind of source (prose, code) gets an equal
// share, split between its sources in proportion to the square root of their sizes, so that prose is
// not drowned by kernel C; quotas are filled with whole documents in corpus order, lines of <= 4 KB.
absl::StatusOr<std::vector<std::string>> SampleTokenizerLines(const std::vector<Source>& sources,
                                                              const std::vector<const Document*>& order,
                                                              int64_t total) {
  std::map<std::string, double> kind_weight;  // kind -> sum of its sources' weights
  std::vector<double> weight(sources.size());
  for (size_t s = 0; s < sources.size(); ++s) {
    weight[s] = std::sqrt(static_cast<double>(sources[s].stats.listed_bytes));
    kind_weight[sources[s].kind] += weight[s];
  }
  std::vector<int64_t> quota(sources.size()), taken(sources.size(), 0);
  for (size_t s = 0; s < sources.size(); ++s) {
    const double share = weight[s] / std::max(kind_weight[sources[s].kind], 1.0) / kind_weight.size();
    quota[s] = static_cast<int64_t>(std::ceil(total * share));
  }
  std::vector<std::string> lines;
  for (const Document* d : order) {
    if (d->val || taken[d->source] >= quota[d->source]) continue;
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> texts, ReadParts(*d));
    for (const std::string& text : texts) {
      if (!SkipReason(text, sources[d->source].kind == "code").empty()) continue;
      for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
        if (line.size() > 4096 || taken[d->source] >= quota[d->source]) continue;
        lines.emplace_back(line);
        taken[d->source]++;
      }
    }
  }
  return lines;
}

// --- shards ------------------------------------------------------------------------------------------

// Writes one split as shards of at most `shard_tokens` uint16 ids, each atomically, with its SHA-256.
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, int64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens) {}

  absl::Status Append(const std::vector<int32_t>& tokens) {
    size_t i = 0;
    while (i < tokens.size()) {
      if (!writer_.has_value()) ORYX_RETURN_IF_ERROR(OpenShard());
      const size_t n = std::min<size_t>(tokens.size() - i, shard_tokens_ - in_shard_);
      buffer_.resize(n * 2);
      for (size_t k = 0; k < n; ++k) {
        const uint16_t t = static_cast<uint16_t>(tokens[i + k]);
        buffer_[2 * k] = static_cast<char>(t & 0xFF);
        buffer_[2 * k + 1] = static_cast<char>(t >> 8);
      }
      ORYX_RETURN_IF_ERROR(writer_->Append(buffer_));
      hasher_.Update(buffer_);
      in_shard_ += static_cast<int64_t>(n);
      i += n;
      if (in_shard_ == shard_tokens_) ORYX_RETURN_IF_ERROR(CloseShard());
    }
    return absl::OkStatus();
  }

  absl::Status Finish() { return writer_.has_value() ? CloseShard() : absl::OkStatus(); }
  const std::vector<CorpusShardInfo>& shards() const { return shards_; }

 private:
  absl::Status OpenShard() {
    const std::string name = absl::StrFormat("%s-%05d.bin", prefix_, shards_.size());
    ORYX_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::Open(dir_ + "/" + name));
    writer_.emplace(std::move(w));
    hasher_ = Sha256();
    in_shard_ = 0;
    shards_.push_back({name, 0, ""});
    return absl::OkStatus();
  }
  absl::Status CloseShard() {
    ORYX_RETURN_IF_ERROR(writer_->Commit());
    writer_.reset();
    shards_.back().tokens = in_shard_;
    shards_.back().sha256 = hasher_.HexDigest();
    return absl::OkStatus();
  }

  std::string dir_;
  std::string prefix_;
  int64_t shard_tokens_;
  std::optional<AtomicFileWriter> writer_;
  Sha256 hasher_;
  int64_t in_shard_ = 0;
  std::string buffer_;
  std::vector<CorpusShardInfo> shards_;
};

json ShardsJson(const std::vector<CorpusShardInfo>& shards) {
  json a = json::array();
  for (const CorpusShardInfo& s : shards)
    a.push_back({{"file", s.file}, {"tokens", s.tokens}, {"sha256", s.sha256}});
  return a;
}

// --- progress ----------------------------------------------------------------------------------------

class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), start_(Clock::now()), last_(start_) {}
  double Seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  void Update(int64_t docs, int64_t tokens, int64_t bytes, bool force = false) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::seconds(5)) return;
    last_ = now;
    const double s = std::max(Seconds(), 1e-9);
    std::cerr << absl::StrFormat(
        "oryx data: %9d docs %10.2fM tokens %9.1f MB  %6.2f MB/s  %8.0f tokens/s  %5.0f s\n", docs,
        tokens / 1e6, bytes / 1e6, bytes / 1e6 / s, tokens / s, s);
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  Clock::time_point start_;
  Clock::time_point last_;
};

// --- tokenising ----------------------------------------------------------------------------------------

struct Batch {
  std::vector<const Document*> docs;
  std::vector<std::vector<std::string>> texts;  // per part
  std::vector<std::vector<std::string>> skip;   // per part: reason, or "" when kept
  std::vector<int64_t> kept_bytes;              // of the kept parts
  std::vector<std::vector<int32_t>> tokens;     // BOS ... EOS; empty when no part is kept
};

// Tokenises each document of the batch: the parts that are no good (SkipReason) left out, the others
// joined (PartTitle before each when documents are runs of files).
void TokenizeBatch(const Tokenizer& tok, const std::vector<Source>& sources, bool titled, Batch* b,
                   int threads) {
  const size_t n = b->docs.size();
  b->skip.assign(n, {});
  b->kept_bytes.assign(n, 0);
  b->tokens.assign(n, {});
  auto work = [&](size_t first) {
    for (size_t i = first; i < n; i += threads) {
      const Document& d = *b->docs[i];
      std::string joined;
      bool any = false;
      for (size_t k = 0; k < d.parts.size(); ++k) {
        const std::string& text = b->texts[i][k];
        b->skip[i].push_back(SkipReason(text, sources[d.source].kind == "code"));
        if (!b->skip[i].back().empty()) continue;
        any = true;
        b->kept_bytes[i] += d.parts[k].bytes;
        if (!titled) continue;
        if (!joined.empty()) joined += joined.back() == '\n' ? "\n" : "\n\n";
        joined += PartTitle(d.parts[k]);
        joined += text;
      }
      if (!any) continue;
      const std::string& text = titled ? joined : b->texts[i][0];
      std::vector<int32_t>& t = b->tokens[i];
      t.reserve(text.size() / 3 + 2);
      t.push_back(kBosId);
      tok.EncodeAppend(text, &t);
      t.push_back(kEosId);
    }
  };
  if (threads <= 1) {
    work(0);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, static_cast<size_t>(t));
  for (std::thread& th : pool) th.join();
}

struct TokenizeResult {
  std::vector<CorpusShardInfo> shards[2];
  int64_t documents[2] = {0, 0};
  int64_t tokens[2] = {0, 0};
  int64_t text_bytes = 0;
  std::map<std::string, std::array<int64_t, 2>> kinds;  // kind -> {documents, tokens}, both splits
  int64_t code_tokens = 0;
  int64_t code_capped_documents = 0;
  int64_t code_capped_tokens = 0;
  bool stopped_early = false;
};

absl::StatusOr<TokenizeResult> TokenizeAll(const Tokenizer& tok, std::vector<Source>& sources,
                                           const std::vector<const Document*>& order,
                                           const PrepareCorpusOptions& o) {
  ShardWriter writers[2] = {ShardWriter(o.out_dir, "train", o.shard_tokens),
                            ShardWriter(o.out_dir, "val", o.shard_tokens)};
  TokenizeResult r;
  Progress progress(o.progress);
  constexpr int64_t kBatchBytes = 8 << 20;
  size_t next = 0;
  while (next < order.size() && !r.stopped_early) {
    Batch b;
    int64_t batch_bytes = 0;
    while (next < order.size() && batch_bytes < kBatchBytes && b.docs.size() < 4096) {
      const Document* d = order[next++];
      ORYX_ASSIGN_OR_RETURN(std::vector<std::string> texts, ReadParts(*d));
      batch_bytes += d->bytes;
      b.docs.push_back(d);
      b.texts.push_back(std::move(texts));
    }
    TokenizeBatch(tok, sources, o.min_document_bytes > 0, &b, o.threads);
    for (size_t i = 0; i < b.docs.size(); ++i) {
      Source& source = sources[b.docs[i]->source];
      SourceStats& st = source.stats;
      for (const std::string& reason : b.skip[i]) {
        if (!reason.empty()) st.skipped[reason]++;
      }
      if (b.tokens[i].empty()) continue;
      const int64_t n = static_cast<int64_t>(b.tokens[i].size());
      const int64_t total = r.tokens[0] + r.tokens[1];
      // The code cap is decided here, in document order, so that it depends on nothing but the inputs:
      // a code document is kept only while code stays within max_code_fraction of all tokens kept. The
      // files of a document left out count as skipped "code_cap".
      const bool code = source.kind == "code";
      if (code && static_cast<double>(r.code_tokens + n) > o.max_code_fraction * static_cast<double>(total + n)) {
        for (const std::string& reason : b.skip[i]) st.skipped["code_cap"] += reason.empty();
        r.code_capped_documents++;
        r.code_capped_tokens += n;
        continue;
      }
      const int split = b.docs[i]->val ? 1 : 0;
      ORYX_RETURN_IF_ERROR(writers[split].Append(b.tokens[i]));
      st.documents[split]++;
      st.tokens[split] += n;
      st.text_bytes += b.kept_bytes[i];
      r.documents[split]++;
      r.tokens[split] += n;
      r.text_bytes += b.kept_bytes[i];
      r.kinds[source.kind][0]++;
      r.kinds[source.kind][1] += n;
      if (code) r.code_tokens += n;
      if (o.max_tokens > 0 && r.tokens[0] + r.tokens[1] >= o.max_tokens) {
        r.stopped_early = next < order.size() || i + 1 < b.docs.size();
        break;
      }
    }
    progress.Update(r.documents[0] + r.documents[1], r.tokens[0] + r.tokens[1], r.text_bytes);
  }
  progress.Update(r.documents[0] + r.documents[1], r.tokens[0] + r.tokens[1], r.text_bytes, /*force=*/true);
  for (int split = 0; split < 2; ++split) {
    ORYX_RETURN_IF_ERROR(writers[split].Finish());
    r.shards[split] = writers[split].shards();
  }
  return r;
}

// --- manifest ----------------------------------------------------------------------------------------

json SourcesJson(const std::vector<Source>& sources) {
  json a = json::array();
  for (const Source& s : sources) {
    json packages = json::array();
    for (const auto& [name, version] : s.packages) packages.push_back({{"name", name}, {"version", version}});
    json skipped = json::object();
    for (const auto& [reason, n] : s.stats.skipped) skipped[reason] = n;
    a.push_back({{"name", s.name},
                 {"kind", s.kind},
                 {"packages", packages},
                 {"files_listed", s.stats.listed_documents},
                 {"bytes_listed", s.stats.listed_bytes},
                 {"skipped", skipped},
                 {"text_bytes", s.stats.text_bytes},
                 {"train", {{"documents", s.stats.documents[0]}, {"tokens", s.stats.tokens[0]}}},
                 {"val", {{"documents", s.stats.documents[1]}, {"tokens", s.stats.tokens[1]}}}});
  }
  return a;
}

// Documents and tokens by kind of source (both splits), the share of code, and what the code cap left out.
json KindsJson(const TokenizeResult& r) {
  json kinds = json::object();
  for (const auto& [kind, counts] : r.kinds) kinds[kind] = {{"documents", counts[0]}, {"tokens", counts[1]}};
  const int64_t total = r.tokens[0] + r.tokens[1];
  kinds["code_fraction"] = total > 0 ? static_cast<double>(r.code_tokens) / static_cast<double>(total) : 0.0;
  kinds["code_capped"] = {{"documents", r.code_capped_documents}, {"tokens", r.code_capped_tokens}};
  return kinds;
}

// Removes shards of an earlier run that the new manifest does not list.
void RemoveStaleShards(const std::string& dir, const TokenizeResult& r) {
  std::vector<std::string> keep;
  for (const auto& split : r.shards) {
    for (const CorpusShardInfo& s : split) keep.push_back(s.file);
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard =
        (absl::StartsWith(name, "train-") || absl::StartsWith(name, "val-")) && absl::EndsWith(name, ".bin");
    if (shard && std::find(keep.begin(), keep.end(), name) == keep.end()) fs::remove(entry.path(), ec);
  }
}

absl::Status CheckOptions(const PrepareCorpusOptions& o) {
  if (o.out_dir.empty()) return absl::InvalidArgumentError("no output directory (--out)");
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--val-fraction must be in [0, 1), got ", o.val_fraction));
  }
  if (o.shard_tokens <= 0) return absl::InvalidArgumentError("--shard-tokens must be positive");
  if (o.max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  if (o.threads < 1 || o.threads > 256) return absl::InvalidArgumentError("--threads must be in [1, 256]");
  if ((!o.input_dir.empty() || !o.input_code_dir.empty()) && !o.sources.empty()) {
    return absl::InvalidArgumentError("--sources and --input-dir/--input-code-dir exclude each other");
  }
  if (o.min_document_bytes < 0) return absl::InvalidArgumentError("--min-document-bytes must be >= 0");
  if (!(o.max_code_fraction >= 0 && o.max_code_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-code-fraction must be in [0, 1], got ", o.max_code_fraction));
  }
  for (const std::string& name : o.sources) {
    bool known = false;
    for (const SourceDef& def : SourceDefs()) known |= def.info.name == name;
    if (!known) {
      std::string names;
      for (const SourceDef& def : SourceDefs()) absl::StrAppend(&names, " ", def.info.name);
      return absl::InvalidArgumentError(absl::StrCat("unknown source '", name, "' (known:", names, ")"));
    }
  }
  if (o.tokenizer_path.empty() && (o.vocab_size < kMinVocabSize || o.vocab_size > 65536)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab must be in [", kMinVocabSize, ", 65536] (uint16 shards), got ", o.vocab_size));
  }
  return absl::OkStatus();
}

// Copies the given tokenizer, or trains one, into the corpus; returns it loaded.
absl::StatusOr<Tokenizer> PrepareTokenizer(const PrepareCorpusOptions& o, const std::vector<Source>& sources,
                                           const std::vector<const Document*>& order, json* info) {
  const std::string dest = o.out_dir + "/tokenizer.model";
  std::string model;
  if (!o.tokenizer_path.empty()) {
    ORYX_ASSIGN_OR_RETURN(model, ReadFile(o.tokenizer_path));
    (*info)["trained_by_prepare"] = false;
  } else {
    const auto start = std::chrono::steady_clock::now();
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> lines,
                          SampleTokenizerLines(sources, order, o.tokenizer_sentences));
    if (o.progress) {
      std::cerr << "oryx data: training the tokenizer (BPE, vocab " << o.vocab_size << ") on " << lines.size()
                << " lines\n";
    }
    ORYX_ASSIGN_OR_RETURN(model, TrainTokenizerFromSentences(lines, o.vocab_size));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (o.progress) std::cerr << absl::StrFormat("oryx data: tokenizer trained in %.1f s\n", secs);
    (*info)["trained_by_prepare"] = true;
    (*info)["training_lines"] = lines.size();
  }
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok,
                        Tokenizer::FromBytes(model, o.tokenizer_path.empty() ? dest : o.tokenizer_path));
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(dest, model));
  (*info)["file"] = "tokenizer.model";
  (*info)["sha256"] = Sha256Hex(model);
  (*info)["vocab_size"] = tok.vocab_size();
  (*info)["bos_id"] = tok.bos_id();
  (*info)["eos_id"] = tok.eos_id();
  (*info)["pad_id"] = tok.pad_id();
  return tok;
}

}  // namespace

const std::vector<CorpusSourceInfo>& BuiltinCorpusSources() {
  static const auto* infos = [] {
    auto* v = new std::vector<CorpusSourceInfo>;
    for (const SourceDef& d : SourceDefs()) v->push_back(d.info);
    return v;
  }();
  return *infos;
}

absl::StatusOr<CorpusSummary> PrepareCorpus(const PrepareCorpusOptions& o) {
  ORYX_RETURN_IF_ERROR(CheckOptions(o));
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(o.out_dir, ": cannot create: ", ec.message()));
  const std::string work_dir = o.work_dir.empty() ? o.out_dir + "/.work" : o.work_dir;

  ORYX_ASSIGN_OR_RETURN(std::vector<Source> sources, ListSources(o, work_dir));
  std::vector<const Document*> order;
  for (const Source& s : sources) {
    for (const Document& d : s.documents) order.push_back(&d);
  }
  if (order.empty()) return absl::NotFoundError("no documents found in the chosen sources");
  std::sort(order.begin(), order.end(), [](const Document* a, const Document* b) {
    return a->order != b->order ? a->order < b->order : a->id < b->id;
  });

  json tokenizer_info;
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok, PrepareTokenizer(o, sources, order, &tokenizer_info));
  if (tok.vocab_size() > 65536) return absl::InvalidArgumentError("tokenizer vocabulary exceeds 65536");

  const auto tokenize_start = std::chrono::steady_clock::now();
  ORYX_ASSIGN_OR_RETURN(TokenizeResult r, TokenizeAll(tok, sources, order, o));
  const auto end = std::chrono::steady_clock::now();

  json manifest = {
      {"format_version", kCorpusFormatVersion},
      {"kind", "oryx-corpus"},
      {"token_dtype", "uint16"},
      {"byte_order", "little"},
      {"document_layout", "BOS tokens EOS, documents concatenated; shards split only by size"},
      {"document_parts",
       o.min_document_bytes > 0
           ? "a document is a run of consecutive files of one source (path order) of at least "
             "min_document_bytes, each file after a line \"==> <path> <==\" and a blank line; <path> names "
             "the first file in the split rule and the order"
           : "a document is one file"},
      {"tokenizer", tokenizer_info},
      {"document_order", "ascending SHA-256(\"<source>/<path>\") bytes 8..15"},
      {"split_rule", "validation when SHA-256(\"<source>/<path>\") bytes 0..7 / 2^64 < val_fraction"},
      {"options",
       {{"val_fraction", o.val_fraction},
        {"max_tokens", o.max_tokens},
        {"shard_tokens", o.shard_tokens},
        {"max_document_bytes", o.max_document_bytes},
        {"min_document_bytes", o.min_document_bytes},
        {"max_code_fraction", o.max_code_fraction},
        {"tokenizer_sentences", o.tokenizer_sentences},
        {"input_dir", o.input_dir.empty() ? json(nullptr) : json(o.input_dir)},
        {"input_code_dir", o.input_code_dir.empty() ? json(nullptr) : json(o.input_code_dir)}}},
      {"stopped_early", r.stopped_early},
      {"documents_available", order.size()},
      {"kinds", KindsJson(r)},
      {"sources", SourcesJson(sources)},
      {"splits",
       {{"train",
         {{"documents", r.documents[0]}, {"tokens", r.tokens[0]}, {"shards", ShardsJson(r.shards[0])}}},
        {"val",
         {{"documents", r.documents[1]}, {"tokens", r.tokens[1]}, {"shards", ShardsJson(r.shards[1])}}}}},
  };
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(o.out_dir + "/manifest.json", JsonText(manifest, 2) + "\n"));
  RemoveStaleShards(o.out_dir, r);

  CorpusSummary summary;
  summary.train = {r.documents[0], r.tokens[0], static_cast<int64_t>(r.shards[0].size())};
  summary.val = {r.documents[1], r.tokens[1], static_cast<int64_t>(r.shards[1].size())};
  summary.text_bytes = r.text_bytes;
  summary.code_tokens = r.code_tokens;
  summary.code_capped_documents = r.code_capped_documents;
  summary.code_capped_tokens = r.code_capped_tokens;
  summary.seconds = std::chrono::duration<double>(end - start).count();
  summary.tokenize_seconds = std::chrono::duration<double>(end - tokenize_start).count();
  return summary;
}

// --- pack / unpack -----------------------------------------------------------------------------------

namespace {

// Writes the first `tokens` ids of a shard as a new shard file; returns its info and counts BOS ids.
absl::StatusOr<CorpusShardInfo> WriteShardPrefix(const CorpusReader& reader, int64_t first_token,
                                                 int64_t tokens, const std::string& path, int32_t bos,
                                                 int64_t* documents) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  ORYX_RETURN_IF_ERROR(reader.ReadTokens(first_token, tokens, ids.data()));
  std::string bytes(ids.size() * 2, '\0');
  for (size_t k = 0; k < ids.size(); ++k) {
    bytes[2 * k] = static_cast<char>(ids[k] & 0xFF);
    bytes[2 * k + 1] = static_cast<char>(ids[k] >> 8);
    *documents += ids[k] == bos;
  }
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(path, bytes));
  return CorpusShardInfo{fs::path(path).filename().string(), tokens, Sha256Hex(bytes)};
}

absl::Status CopyInto(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot copy ", from, " to ", to, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PackSummary> PackCorpus(const PackCorpusOptions& o) {
  if (o.compression != "xz" && o.compression != "gzip") {
    return absl::InvalidArgumentError(absl::StrCat("--compression must be xz or gzip, got ", o.compression));
  }
  if (o.max_train_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  ORYX_ASSIGN_OR_RETURN(CorpusReader train,
                        CorpusReader::Open(o.corpus_dir, "train", /*verify_checksums=*/true));
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(o.corpus_dir, "val", /*verify_checksums=*/true));
  const CorpusManifest& m = train.manifest();
  const std::string staging = o.out_path + ".staging";
  std::error_code ec;
  (void)RemoveTree(staging);
  fs::create_directories(staging, ec);
  if (ec) return absl::InternalError(absl::StrCat(staging, ": cannot create: ", ec.message()));

  ORYX_RETURN_IF_ERROR(CopyInto(o.corpus_dir + "/" + m.tokenizer_file, staging + "/" + m.tokenizer_file));
  for (const CorpusShardInfo& s : m.splits.at("val").shards) {
    ORYX_RETURN_IF_ERROR(CopyInto(o.corpus_dir + "/" + s.file, staging + "/" + s.file));
  }
  // The train prefix: whole shards, then the first part of the next one.
  std::vector<CorpusShardInfo> kept;
  int64_t kept_tokens = 0, kept_documents = 0, first = 0;
  for (const CorpusShardInfo& s : m.splits.at("train").shards) {
    const int64_t take = std::min(s.tokens, o.max_train_tokens - kept_tokens);
    if (take <= 0) break;
    ORYX_ASSIGN_OR_RETURN(CorpusShardInfo info, WriteShardPrefix(train, first, take, staging + "/" + s.file,
                                                                 m.bos_id, &kept_documents));
    kept.push_back(info);
    kept_tokens += take;
    first += s.tokens;
  }
  json manifest = m.json;
  manifest["splits"]["train"] = {
      {"documents", kept_documents}, {"tokens", kept_tokens}, {"shards", ShardsJson(kept)}};
  manifest["packed"] = {
      {"from_train_tokens", m.splits.at("train").tokens},
      {"from_train_documents", m.splits.at("train").documents},
      {"max_train_tokens", o.max_train_tokens},
      {"note", "train is a prefix of the full corpus's train split; documents counts BOS ids"}};
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(staging + "/manifest.json", JsonText(manifest, 2) + "\n"));

  // A reproducible tar (sorted names, fixed owner and time), compressed single-threaded.
  const std::string tar_path = o.out_path + ".tmp.tar";
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-C", staging, "--sort=name", "--owner=0", "--group=0",
                                   "--numeric-owner", "--mtime=@0", "-cf", tar_path, "."}));
  CommandOptions c;
  c.stdout_path = o.out_path + ".tmp";
  if (o.compression == "xz") {
    ORYX_RETURN_IF_ERROR(RunCommand({"xz", "-9", "-T1", "-c", tar_path}, c));
  } else {
    ORYX_RETURN_IF_ERROR(RunCommand({"gzip", "-9", "-n", "-c", tar_path}, c));
  }
  fs::rename(c.stdout_path, o.out_path, ec);
  if (ec) return absl::InternalError(absl::StrCat(o.out_path, ": cannot rename: ", ec.message()));
  fs::remove(tar_path, ec);
  (void)RemoveTree(staging);

  PackSummary summary;
  summary.train_tokens = kept_tokens;
  summary.val_tokens = val.num_tokens();
  summary.archive_bytes = static_cast<int64_t>(fs::file_size(o.out_path, ec));
  return summary;
}

absl::Status UnpackCorpus(const std::string& archive_path, const std::string& out_dir) {
  std::error_code ec;
  if (!fs::is_regular_file(archive_path, ec))
    return absl::NotFoundError(absl::StrCat(archive_path, ": no such archive"));
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-xf", archive_path, "-C", out_dir, "--no-same-owner"}));
  ORYX_ASSIGN_OR_RETURN(CorpusManifest m, ReadCorpusManifest(out_dir));
  for (const auto& [split, info] : m.splits) {
    ORYX_RETURN_IF_ERROR(CorpusReader::Open(out_dir, split, /*verify_checksums=*/true).status());
  }
  ORYX_ASSIGN_OR_RETURN(std::string tok, ReadFile(out_dir + "/" + m.tokenizer_file));
  if (Sha256Hex(tok) != m.tokenizer_sha256) {
    return absl::DataLossError(
        absl::StrCat(out_dir, "/", m.tokenizer_file, ": SHA-256 does not match the manifest"));
  }
  return absl::OkStatus();
}

}  // namespace oryx
