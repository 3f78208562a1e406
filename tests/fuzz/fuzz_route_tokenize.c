/*
 * fuzz_route_tokenize.c - libFuzzer target for the /tokenize and
 * /detokenize routes' JSON decoders: each input is posted to both on the
 * real `kvd serve` in this process (tests/fuzz/route_fuzz.h says how, and
 * what every answer must be). Seeds in corpus/route_tokenize/, tokens in
 * route_tokenize.dict. Built and run by `make fuzz`.
 */
#include "tests/fuzz/route_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    route_post("/tokenize", data, size);
    route_post("/detokenize", data, size);
    return 0;
}
