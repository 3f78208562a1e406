// The official `openai` npm client, unchanged, against kvd's
// /v1/chat/completions: one plain request and the same one streamed.
// Usage: NODE_PATH=DIR/node_modules node openai_client.cjs BASE_URL
// Prints one JSON line with what the client saw; exits 1 on any error.
const OpenAI = require('openai');

const client = new OpenAI({ baseURL: process.argv[2], apiKey: 'unused', maxRetries: 0 });
const request = {
  model: 'kvd',
  messages: [
    { role: 'system', content: 'You tell stories.' },
    { role: 'user', content: 'Once upon a time' },
  ],
  max_tokens: 8,
  temperature: 0,
};

(async () => {
  const r = await client.chat.completions.create(request);
  const out = {
    plain: {
      id: r.id,
      object: r.object,
      role: r.choices[0].message.role,
      content: r.choices[0].message.content,
      finish: r.choices[0].finish_reason,
      usage: r.usage,
    },
  };
  const stream = await client.chat.completions.create({
    ...request,
    stream: true,
    stream_options: { include_usage: true },
  });
  let content = '', role = null, finish = null, usage = null, chunks = 0;
  for await (const c of stream) {
    chunks++;
    if (c.choices.length) {
      const d = c.choices[0].delta;
      if (d.role) role = d.role;
      if (d.content) content += d.content;
      if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
    }
    if (c.usage) usage = c.usage;
  }
  out.stream = { role, content, finish, usage, chunks };
  console.log(JSON.stringify(out));
})().catch((e) => {
  console.error(String(e));
  process.exit(1);
});
