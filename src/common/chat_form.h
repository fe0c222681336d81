/*
 * chat_form.h -- the words of K3's chat format that frame an assistant turn,
 * in one place for the three that speak it: the encoder that renders turns
 * (src/tokenizer/chat_json.c), the grammar that constrains a generated turn
 * (src/grammar/compile.c) and the parser that reads one back
 * (src/tokenizer/chat_reply.c). A tag is a special token, a name (and
 * attributes), then <|sep|>:
 *
 *   <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
 *   <|open|>tools<|sep|>
 *     <|open|>call tool="NAME" index="N"<|sep|>
 *       <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>
 *     | <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>
 *     <|close|>call<|sep|>
 *   <|close|>tools<|sep|> <|close|>message<|sep|> <|end_of_msg|>
 *
 * The four specials are single tokens: a cut (max_tokens) can fall between
 * tokens of a tag, never inside one of them.
 */
#ifndef K3_COMMON_CHAT_FORM_H
#define K3_COMMON_CHAT_FORM_H

#define K3_FORM_OPEN "<|open|>"
#define K3_FORM_CLOSE "<|close|>"
#define K3_FORM_SEP "<|sep|>"
#define K3_FORM_END_OF_MSG "<|end_of_msg|>"

/* channels and blocks */
#define K3_FORM_THINK "think"
#define K3_FORM_RESPONSE "response"
#define K3_FORM_TOOLS "tools"
#define K3_FORM_MESSAGE "message"
#define K3_FORM_CALL "call"
#define K3_FORM_ARGUMENT "argument"
#define K3_FORM_JSON "json"

/* attributes: <|open|>call tool="NAME" index="N"<|sep|>,
 * <|open|>argument key="K" type="T"<|sep|>, <|open|>json type="object"<|sep|> */
#define K3_FORM_ATTR_TOOL "tool"
#define K3_FORM_ATTR_INDEX "index"
#define K3_FORM_ATTR_KEY "key"
#define K3_FORM_ATTR_TYPE "type"

#endif /* K3_COMMON_CHAT_FORM_H */
