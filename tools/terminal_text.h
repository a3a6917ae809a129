// Text from a checkpoint (tensor names, metadata, file names, error messages that quote them) made
// safe to print: a crafted name must not send escape sequences to the terminal or fake a line.
#pragma once

#include <string>
#include <string_view>

namespace fsdp_ema::tools {

// `text` with every control character (C0, DEL, C1), Unicode bidirectional override / isolate
// (U+202A..U+202E, U+2066..U+2069, which can make a name read as another) and byte of invalid UTF-8
// written as an escape: \n, \r, \t, \e, \\ (the backslash itself, so escapes stay unambiguous),
// \xNN for other bytes, \uNNNN for code points. Printable UTF-8 is kept as it is.
std::string printable(std::string_view text);

}  // namespace fsdp_ema::tools
